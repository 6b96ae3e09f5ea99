"""What `benchctl sample` (and the study's sample stage) can be asked for, and the defaults of every option.

Cheap to import: the command line reads the defaults when it is built (`benchctl --help`), long before any model.
"""

from __future__ import annotations

# Defaults, recorded with every sample. temperature 1.0 / top-k 300: llama2.c's sample.py. 256 new tokens: run.c's
# default length, and enough for ~85% of TinyStories validation continuations (median ~160 tokens at vocab 4096)
# to end by themselves. 50 prompts per model: the study's scale for a judged comparison.
DEFAULT_N_PROMPTS = 50
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_K = 300
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_SEED = 0
DEFAULT_BATCH_SIZE = 64
DEFAULT_EXIT_THRESHOLD = 5e-4  # Huginn's default for its KL exit
