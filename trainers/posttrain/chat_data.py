"""Post-training data the trainers read on the ranks: conversations and preference pairs from
`files:`/`hf:` datasets, JSONL rows, and the verifiable rewards of math answers (GRPO, APO pairs).

The posttrain_data step (tasks/posttrain/data.py) writes the files these read, with the
conversations of `files:`/`hf:` datasets (`external_conversations`, held-out rows picked by a
stable hash of the row index) and `data_state`, the digest of local data files in its fingerprint.
"""

from __future__ import annotations

import glob
import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from trainers.posttrain.sections import ChatDataConfig

_ANSWER = re.compile(r"Answer:\s*(-?\d+)")


_FORMAT = re.compile(r"\S.*\nAnswer: -?\d+\s*$", re.S)


ROLES = {"system", "user", "assistant", "tool"}


def extract_answer(text: str) -> str | None:
    """The integer after the first `Answer:` (what the worked solutions end with), or None."""
    m = _ANSWER.search(text)
    return m.group(1) if m else None


def question(prompt: list[dict[str, Any]]) -> str:
    """A chat prompt's last user turn (what a reference solution is keyed by; the system turn
    before it only names the reasoning mode)."""
    return next(m["content"] for m in reversed(prompt) if m["role"] == "user")


def conversation_mode(messages: Sequence[dict[str, Any]]) -> str:
    """The reasoning mode the chat template renders a conversation in: `no_think` when its system
    turn says `/no_think`, else `think` (the template's default, and `/think`)."""
    first = messages[0] if messages else {}
    return "no_think" if first.get("role") == "system" and "/no_think" in str(first.get("content")) else "think"


def by_mode(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Conversation rows split by reasoning mode (`think`, `no_think`), modes without rows left out."""
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(conversation_mode(row["messages"]), []).append(row)
    return dict(sorted(out.items(), key=lambda kv: kv[0] != "think"))


def is_correct(text: str, answer: str) -> bool:
    return extract_answer(text) == str(answer).strip()


def _text(completion: Any) -> str:
    # TRL passes conversational completions as [{"role": "assistant", "content": ...}].
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion)
    return str(completion)


def exact_match_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the completion's final answer equals the known answer, else 0.0."""
    return [1.0 if is_correct(_text(c), a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def format_reward(completions: list[Any], **_: Any) -> list[float]:
    """1.0 when the completion is a worked solution ending in `Answer: N` on its own line."""
    return [1.0 if _FORMAT.match(_text(c).strip()) else 0.0 for c in completions]


def check_messages(messages: Any, where: str) -> str | None:
    """Why `messages` is not a usable conversation (None when it is)."""
    if not isinstance(messages, list) or not messages:
        return "not_a_list"
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            return "bad_message"
    if not any(m["role"] == "assistant" for m in messages):
        return "no_assistant_turn"
    return None


def load_rows(uri: str, cfg: ChatDataConfig, streaming: bool = False) -> Iterator[dict[str, Any]]:
    """Raw rows of a `files:GLOB`, `hf:NAME` or `hf:/PATH` dataset; with `streaming` a hub
    dataset is streamed rather than downloaded whole (a saved one is memory-mapped either way)."""
    target = uri.split(":", 1)[1]
    if uri.startswith("files:"):
        paths = sorted(glob.glob(str(Path(target).expanduser()), recursive=True))
        if not paths:
            raise FileNotFoundError(f"posttrain data {uri!r}: no file matches {target!r}")
        for path in paths:
            with open(path, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)
                        except json.JSONDecodeError as exc:
                            raise ValueError(f"posttrain data {path}:{n}: invalid JSON ({exc})") from None
        return
    import datasets

    if Path(target).expanduser().exists():
        ds = datasets.load_from_disk(str(Path(target).expanduser()))
        if isinstance(ds, datasets.DatasetDict):
            ds = datasets.concatenate_datasets([_disk_split(ds, part, uri) for part in cfg.hf_split.split("+")])
    else:
        ds = datasets.load_dataset(
            target, cfg.hf_subset, split=cfg.hf_split, revision=cfg.hf_revision, streaming=streaming
        )
    yield from ds


_SLICE = re.compile(r"^(?P<name>[^\[]+)(?:\[:(?P<n>\d+)(?P<pct>%?)\])?$")


def _disk_split(ds, part: str, uri: str):
    """One part of a split spec (`name`, `name[:N]`, `name[:N%]`: the first rows, as the hub's
    split syntax) of a saved DatasetDict."""
    m = _SLICE.match(part.strip())
    if not m or m["name"] not in ds:
        raise KeyError(f"posttrain data {uri!r}: no split {part!r}; splits: {', '.join(ds)}")
    split = ds[m["name"]]
    if m["n"] is None:
        return split
    n = len(split) * int(m["n"]) // 100 if m["pct"] else int(m["n"])
    return split.select(range(min(n, len(split))))


def write_jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def preference_rows(
    uri: str,
    subset: str | None = None,
    split: str = "train",
    revision: str | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """prompt/chosen/rejected rows of a preference dataset (files:/hf:), checked.

    Rows whose chosen/rejected are whole conversations (UltraFeedback-binarized style: the prompt
    repeated as the first turns) are split into a message-list prompt and the final replies."""
    where = ChatDataConfig(uri=uri, hf_subset=subset, hf_split=split, hf_revision=revision)
    rows = []
    for i, row in enumerate(load_rows(uri, where)):
        if limit and i >= limit:
            break
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
        if missing:
            raise ValueError(
                f"preference data {uri!r} row {i}: missing {', '.join(missing)}; each row needs "
                "prompt, chosen and rejected (strings or message lists)"
            )
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
        if isinstance(chosen, list) and len(chosen) > 1 and isinstance(rejected, list):
            prompt, chosen, rejected = chosen[:-1], chosen[-1:], rejected[-1:]
        elif isinstance(prompt, str) and isinstance(chosen, list):
            prompt = [{"role": "user", "content": prompt}]
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    if not rows:
        raise ValueError(f"preference data {uri!r} holds no rows")
    return rows


def data_state(uri: str) -> str:
    """A digest of local data files (names, sizes, mtimes), so edited data changes fingerprints;
    hub data is pinned by its revision in the config instead."""
    if uri.startswith("files:"):
        paths = [Path(p) for p in sorted(glob.glob(str(Path(uri[6:]).expanduser()), recursive=True))]
    elif uri.startswith("hf:") and Path(uri[3:]).expanduser().exists():
        paths = sorted(p for p in Path(uri[3:]).expanduser().rglob("*") if p.is_file())
    else:
        return ""
    h = hashlib.sha256()
    for p in paths:
        st = p.stat()
        h.update(f"{p}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _held_out(i: int, fraction: float) -> bool:
    h = int(hashlib.sha256(f"posttrain-row:{i}".encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < fraction


def with_mode_flag(messages: list[dict[str, str]], row: dict[str, Any]) -> list[dict[str, str]]:
    """A row's `chat_template_kwargs` (SmolTalk2's rows carry `{"enable_thinking": false}` in
    no-think subsets) as the `/no_think` flag of its system turn, so the conversation renders in
    its own mode when SFT renders every row with one template call. A flag already in the system
    turn wins, as in the template."""
    kwargs = row.get("chat_template_kwargs")
    if not isinstance(kwargs, dict) or kwargs.get("enable_thinking") is not False:
        return messages
    if messages[0]["role"] == "system":
        if "/think" in messages[0]["content"] or "/no_think" in messages[0]["content"]:
            return messages
        return [{"role": "system", "content": f"{messages[0]['content']} /no_think".strip()}, *messages[1:]]
    return [{"role": "system", "content": "/no_think"}, *messages]


def external_conversations(cfg: ChatDataConfig) -> tuple[list[dict], list[dict], Counter]:
    """(train, held-out, rejected counts) from a files:/hf: dataset."""
    train, heldout, rejected = [], [], Counter()
    for i, row in enumerate(load_rows(cfg.uri, cfg)):
        if cfg.max_examples and i >= cfg.max_examples:
            break
        messages = row.get(cfg.messages_field) if isinstance(row, dict) else None
        why = check_messages(messages, f"{cfg.uri} row {i}")
        if why:
            rejected[why] += 1
            continue
        messages = with_mode_flag([{"role": m["role"], "content": m["content"]} for m in messages], row)
        (heldout if _held_out(i, cfg.held_out_fraction) else train).append({"messages": messages})
    if not train:
        raise ValueError(
            f"posttrain data {cfg.uri!r}: no usable conversations in field {cfg.messages_field!r} "
            f"(rejected: {dict(rejected)}); set posttrain.data.messages_field to the right column"
        )
    return train, heldout, rejected
