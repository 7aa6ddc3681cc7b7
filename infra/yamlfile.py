"""YAML for config files (recipes, mixtures, overrides, preflight inputs): safe, strict about keys, bounded.

PyYAML's `safe_load` keeps the last of two equal keys in one mapping (`seed: 0` then `seed: 5`
reads as 5), so a pasted-over line silently changes a run. `load_yaml` builds only plain data
(PyYAML's safe constructors) and refuses a mapping that repeats a key, naming the key and both
lines. Merge keys (`<<: *base`) keep their meaning: a key given next to a merge overrides it.

It also refuses, before any value is built or formatted, documents no config needs and that
would hang or crash whoever reads them (`YamlTooLarge`): nesting deeper than `MAX_DEPTH` (a
5,000-deep `[[[...]]]` made PyYAML's composer and every walker after it recurse past Python's
limit, and its scanner is quadratic in the depth), more than `MAX_NODES` nodes once aliases are
expanded (a "billion laughs" document is a few lines whose aliases expand to 10**9 items: it
grew to gigabytes as soon as anything walked or printed it), and aliases that refer to
themselves (a recursive list).
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_DEPTH = 64  # nested sequences and mappings; recipes use fewer than 8
MAX_NODES = 100_000  # scalars, sequences and mappings, each alias counted as what it expands to


class YamlRefused(ValueError):
    """A YAML document that parses but is refused; the message says what and where."""


class DuplicateKey(YamlRefused):
    """A mapping repeats a key; the message names the key and the lines of both."""


class YamlTooLarge(YamlRefused):
    """A document nested deeper than MAX_DEPTH, expanding to more than MAX_NODES nodes, or
    holding a recursive alias; the message names the bound and the line."""


def _too_deep(mark: Any) -> YamlTooLarge:
    return YamlTooLarge(f"nested deeper than {MAX_DEPTH} levels at line {mark.line + 1}; configs need far fewer")


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader whose mappings refuse repeated keys and whose documents are bounded."""

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:  # noqa: N803 - PyYAML's name
        if self.flow_level >= MAX_DEPTH:  # `[[[[...`: refused while scanning, before the composer recurses
            raise _too_deep(self.get_mark())
        super().fetch_flow_collection_start(TokenClass)

    def add_indent(self, column: int) -> bool:
        if len(self.indents) >= MAX_DEPTH:  # block nesting, by indentation
            raise _too_deep(self.get_mark())
        return super().add_indent(column)

    def construct_document(self, node: yaml.Node) -> Any:
        _expanded_size(node)
        return super().construct_document(node)

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


def _expanded_size(root: yaml.Node) -> int:
    """Nodes of the document with every alias expanded, counted on the composed graph (an
    alias is one shared node there, so this costs one visit per distinct node); raises
    YamlTooLarge past MAX_NODES, past MAX_DEPTH or at a node that contains itself."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise YamlTooLarge(f"a recursive alias at line {node.start_mark.line + 1}: a value that contains itself")
        if depth > MAX_DEPTH:
            raise _too_deep(node.start_mark)
        open_nodes.add(key)
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        total = 1 + sum(size(child, depth + 1) for child in children)
        open_nodes.discard(key)
        if total > MAX_NODES:
            raise YamlTooLarge(
                f"the value at line {node.start_mark.line + 1} expands to more than {MAX_NODES} items "
                "(aliases expanded); configs need far fewer"
            )
        sizes[key] = total
        return total

    return size(root, 0)


def load_yaml(text: str) -> Any:
    """The plain data of one YAML document; YamlRefused (DuplicateKey, YamlTooLarge) or
    yaml.YAMLError when it is not one."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
