"""YAML for config files (recipes, mixtures, overrides, preflight inputs): safe, and strict about keys.

PyYAML's `safe_load` keeps the last of two equal keys in one mapping (`seed: 0` then `seed: 5`
reads as 5), so a pasted-over line silently changes a run. `load_yaml` builds only plain data
(PyYAML's safe constructors) and refuses a mapping that repeats a key, naming the key and both
lines. Merge keys (`<<: *base`) keep their meaning: a key given next to a merge overrides it.
"""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKey(ValueError):
    """A mapping repeats a key; the message names the key and the lines of both."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader whose mappings refuse repeated keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base constructor says so
                continue
            if first is not None:
                raise DuplicateKey(
                    f"key {key!r} appears twice in one mapping (lines {first + 1} and {line + 1}); keep one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """The plain data of one YAML document; DuplicateKey or yaml.YAMLError when it is not one."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
