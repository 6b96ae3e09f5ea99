"""Stage `eval`: lm-eval tasks on every finished run (see `api` for the modules and the public names).

Importing any module of this package first points lm-eval's request cache into benchctl's cache directory:
lm-eval reads LM_HARNESS_CACHE_PATH once, at its own import, and would otherwise write into site-packages
(benchctl does not use lm-eval's request cache).
"""

from __future__ import annotations

import os

from benchctl.core.files import cache_root

os.environ.setdefault("LM_HARNESS_CACHE_PATH", str(cache_root() / "lm_eval_requests"))
