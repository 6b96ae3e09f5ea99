"""The grading prompt: a template file with one `{story}` slot, versioned by the hash of its bytes.

The story is shown the way the TinyStories paper shows it to its grader: the given beginning, then `***`, then the
model's completion. The file's sha256 (first 12 hex digits) is stored with every grade as the prompt version, so
editing the prompt starts a new set of grades instead of mixing old and new ones.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from benchctl.errors import ConfigError

# judge_prompts/ sits at the repository root, beside the benchctl package (and is shipped with it in the wheel).
PROMPT_PATH = Path(__file__).resolve().parents[2] / "judge_prompts" / "story_grading.md"
STORY_SLOT = "{story}"
STORY_SEPARATOR = "***"  # the TinyStories paper marks where the given beginning ends and the completion starts


@dataclass(frozen=True)
class Template:
    text: str
    hash: str  # sha256 of the file bytes, first 12 hex digits
    path: Path

    def fill(self, beginning: str, completion: str) -> str:
        # str.replace, not str.format: stories may contain braces.
        return self.text.replace(STORY_SLOT, format_story(beginning, completion))


def format_story(beginning: str, completion: str) -> str:
    """The story as the judge sees it: the given beginning, then `***`, then the model's completion."""
    return f"{beginning.strip()} {STORY_SEPARATOR} {completion.strip()}"


def load_template(path: str | os.PathLike | None = None) -> Template:
    p = Path(path) if path is not None else PROMPT_PATH
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the judge prompt {p}: {e.strerror}; pass an existing template file") from None
    text = raw.decode("utf-8")
    n = text.count(STORY_SLOT)
    if n != 1:
        raise ConfigError(f"judge prompt {p} must contain the slot {STORY_SLOT} exactly once (found {n})")
    return Template(text=text, hash=hashlib.sha256(raw).hexdigest()[:12], path=p)
