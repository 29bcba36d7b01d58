"""Write what the eval chose into the user's YAML config, in place, keeping its comments and layout.

Only block-style mappings are edited (what `configs/*.yaml` use): a key's value is replaced on its own
line (its comment replaced by one naming the eval), a missing key is added at the end of its parent block, a missing
parent is
added with it. The result is parsed again and checked; a layout this cannot edit is an error naming
the values to set by hand.
"""

from __future__ import annotations

import json
import re

import yaml

_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w-]*):(?P<rest>.*)$")


class ApplyError(ValueError):
    """The config's layout cannot be edited in place; the message says what to set by hand."""


def yaml_scalar(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if re.fullmatch(r"[A-Za-z_./$][\w./${}-]*", str(value)) and yaml.safe_load(str(value)) == value:
        return str(value)  # plain, as people write tier names and paths
    return json.dumps(str(value))  # a double-quoted YAML string


def _block_end(lines: list[str], start: int, indent: int) -> int:
    """First line after `start` that is not inside the block opened at `start` (deeper or blank/comment)."""
    i = start + 1
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped and not stripped.startswith("#") and len(lines[i]) - len(lines[i].lstrip(" ")) <= indent:
            break
        i += 1
    while i > start + 1 and not lines[i - 1].strip():
        i -= 1  # keep blank lines between blocks where they were
    return i


def _find(lines: list[str], lo: int, hi: int, indent: int, key: str) -> int | None:
    for i in range(lo, hi):
        m = _KEY.match(lines[i])
        if m and len(m["indent"]) == indent and m["key"] == key:
            return i
    return None


def set_value(lines: list[str], path: tuple[str, ...], value, comment: str) -> None:
    lo, hi, indent, step = 0, len(lines), 0, 2
    for depth, key in enumerate(path):
        at = _find(lines, lo, hi, indent, key)
        last = depth == len(path) - 1
        if at is None:
            pad = " " * indent
            new = [f"{pad}{key}: {yaml_scalar(value)}  # {comment}"] if last else [f"{pad}{key}:"]
            lines[hi:hi] = new
            at = hi
            if last:
                return
            lo, hi, indent = at + 1, at + 1, indent + step
        elif last:
            # the old comment explained the old value: replace it
            lines[at] = f"{' ' * indent}{key}: {yaml_scalar(value)}  # {comment}"
            return
        else:
            block_hi = _block_end(lines, at, indent)
            child = next((len(m["indent"]) for m in map(_KEY.match, lines[at + 1 : block_hi]) if m), indent + step)
            lo, hi, indent = at + 1, block_hi, child


def apply_values(text: str, values: dict[tuple[str, ...], object], comment: str) -> str:
    """`text` with each dotted path set to its value (and `comment` beside it). Checked by parsing: the
    result must equal the original with exactly these values set, so an edit that lands in the wrong
    block (a quoted key, a duplicate section) is refused rather than written."""
    wanted = ", ".join(f"{'.'.join(p)}: {yaml_scalar(v)}" for p, v in values.items())
    refusal = ApplyError(
        f"could not edit the config in place (flow-style, quoted keys or another unusual layout); set by hand: {wanted}"
    )
    try:
        expected = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        raise refusal from None
    for path, value in values.items():
        node = expected
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[path[-1]] = value
    lines = text.splitlines()
    for path, value in values.items():
        set_value(lines, path, value, comment)
    out = "\n".join(lines) + "\n"
    try:
        if yaml.safe_load(out) == expected:
            return out
    except yaml.YAMLError:
        pass
    raise refusal


def chosen_values(chosen: dict, small: str, large: str, router_path: str | None) -> dict[tuple[str, ...], object]:
    """The config fields a chosen policy sets (the default tier too: without a router it decides every item)."""
    if chosen.get("all_large"):
        return {("route", "default_tier"): large, ("route", "escalation", "enabled"): False, ("route", "router"): None}
    return {
        ("route", "default_tier"): small,
        ("route", "escalation", "enabled"): True,
        ("route", "escalation", "to_tier"): large,
        ("route", "escalation", "min_mean_logprob"): chosen["min_mean_logprob"],
        ("route", "escalation", "on_truncation"): chosen["on_truncation"],
        ("route", "escalation", "on_unfaithful"): chosen["on_unfaithful"],
        ("route", "router"): router_path if chosen["router_threshold"] is not None else None,
    }


def _share(policy: dict) -> str:
    rate = policy["acceptable"]["rate"]
    return "-" if rate is None else f"{rate:.1%}"  # None: no test document answered on both tiers


def decided_by(routing: dict, small: str, large: str, day: str) -> str:
    """The `route.decided_by` line of a chosen policy: the eval that chose it and its figure, which `tokenmill run`
    prints beside the tiers' shares (so that a demo sending everything to one tier says why, with the figure)."""
    chosen, all_large, all_small = routing["chosen"], routing["all_large"], routing["all_small"]
    where = f"tokenmill eval {day}, {routing['test_documents']} test documents"
    target = f"{routing['target_quality']:.0%} of all-{large}'s acceptable share"
    if chosen.get("all_large"):
        return (
            f"{where}: no mix with {small} keeps {target} for less than all-{large} (all-{small} keeps "
            f"{all_small['quality_kept']:.1%}: acceptable {_share(all_small)} against {_share(all_large)})"
        )
    return (
        f"{where}: {chosen['small_share']:.0%} kept on {small}, {chosen['escalated_share']:.0%} escalated, "
        f"{chosen['quality_kept']:.1%} of all-{large}'s acceptable share "
        f"(acceptable {_share(chosen)} against {_share(all_large)}) "
        f"at ${chosen['cost_per_1k_usd']:.3f} per 1k "
        f"(all-{large} ${all_large['cost_per_1k_usd']:.3f})"
    )
