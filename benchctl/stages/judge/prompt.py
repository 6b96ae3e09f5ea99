"""The grading prompt: a template file with one `{story}` slot, versioned by the hash of its bytes and protocol.

The story is shown the way the TinyStories paper shows it to its grader: the given beginning, then `***`, then the
model's completion. Each protocol has its default file: `json` asks for the four grades only, `assess` for the
general assessment the study's text asks for, then the grades. The sha256 (first 12 hex digits) of the file's bytes
is stored with every grade as the prompt version, so editing the prompt starts a new set of grades instead of
mixing old and new ones; for `assess` the protocol name is hashed with the bytes, so even the same file graded under
the two protocols gives two versions and a cached answer of one protocol never stands in for the other (`json`
keeps the plain file hash, which grades stored before protocols existed carry).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from benchctl.core.errors import ConfigError

# judge_prompts/ sits at the repository root, beside the benchctl package (and is shipped with it in the wheel).
PROMPT_DIR = Path(__file__).resolve().parents[3] / "judge_prompts"
PROMPT_PATH = PROMPT_DIR / "story_grading.md"  # the json protocol's
PROMPT_PATHS = {"json": PROMPT_PATH, "assess": PROMPT_DIR / "story_grading_assess.md"}
STORY_SLOT = "{story}"
STORY_SEPARATOR = "***"  # the TinyStories paper marks where the given beginning ends and the completion starts


@dataclass(frozen=True)
class Template:
    text: str
    hash: str  # sha256 of the file bytes (preceded by the protocol name for assess), first 12 hex digits
    path: Path
    protocol: str = "json"

    def fill(self, beginning: str, completion: str) -> str:
        # str.replace, not str.format: stories may contain braces.
        return self.text.replace(STORY_SLOT, format_story(beginning, completion))


def format_story(beginning: str, completion: str) -> str:
    """The story as the judge sees it: the given beginning, then `***`, then the model's completion."""
    return f"{beginning.strip()} {STORY_SEPARATOR} {completion.strip()}"


def load_template(path: str | os.PathLike | None = None, protocol: str = "json") -> Template:
    if protocol not in PROMPT_PATHS:
        raise ConfigError(f"unknown judge protocol {protocol!r}; choose one of {', '.join(PROMPT_PATHS)}")
    p = Path(path) if path is not None else PROMPT_PATHS[protocol]
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the judge prompt {p}: {e.strerror}; pass an existing template file") from None
    text = raw.decode("utf-8")
    n = text.count(STORY_SLOT)
    if n != 1:
        raise ConfigError(f"judge prompt {p} must contain the slot {STORY_SLOT} exactly once (found {n})")
    salt = b"" if protocol == "json" else f"protocol: {protocol}\n".encode()
    return Template(text=text, hash=hashlib.sha256(salt + raw).hexdigest()[:12], path=p, protocol=protocol)
