"""Arms of an evaluation: a fill, optionally with a row selector, and the count-matched random control.

  ridge, identity, none (and the checks plumb, oracle)   the fill alone
  ridge+probe, identity+probe                            the probe: E rows by the budget (paper §2.4, lexical-net
                                                         rows first), or probe_share of the prefix when set
  ridge+attention                                        the attention selector keeps exact_share
  ridge+protected                                        the rarest protected_share of the protected-class tokens
                                                         (needs maps with a token frequency table)
  ridge+blind-probe, ridge+blind-attention               the question-blind controls: the selector's query rows
                                                         end before the tail, so it cannot see the question
  ridge+random:probe, ridge+random:attention             as many random prefix rows as that selector chose on
                                                         the same sample (paper §3.3's equal-cost control)
  ...@values, ...@keys, ...@both                         with the value and/or key rescale (paper §2.3)
A random arm must come after an arm with its selector, which sets its count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

FILLS = ("ridge", "identity", "none", "plumb", "oracle")
SELECTORS = ("probe", "attention", "protected", "blind-probe", "blind-attention")
RESCALES = ("values", "keys", "both")
# the prefill statistics that say which rows ran exactly and what chose them, kept beside each result
ROW_COUNTS = ("n_filled", "n_exact", "n_special", "n_tail", "n_probe_exact", "n_attention", "n_budget", "n_lexical",
              "n_whole_numbers", "n_protected", "n_random")
# llama-server's --ridgefill-budget on a model without sliding-window layers (2 with them: the instruments' default is
# the model's, engine.bindings.budget_default), so that they measure what it serves unless told
SERVER_BUDGET = 1.5


@dataclass(frozen=True)
class Arm:
    name: str
    fill: str
    selector: str | None = None
    random_of: str | None = None   # the selector whose count a random arm matches
    rescale: str | None = None     # values, keys or both


@dataclass
class SelectorOptions:
    exact_share: float = 0.1   # of the prefix, for the attention selector
    budget: float = SERVER_BUDGET  # the probe's budget factor: E = budget x the rows the base rules count
    whole_numbers: bool = True  # with the budget, a number the probe keeps exact in part runs exactly whole
    probe_share: float | None = None  # a fixed share of the prefix for the probe instead of the budget
    protected_share: float = 0.25
    probe_rows: int = 256
    query_rows: int = 64
    rescale_rows: int = 512    # the tail rows that measure the rescales
    seed: int = 0


def parse_arm(name: str) -> Arm:
    base, _, rescale = name.partition("@")
    if rescale and rescale not in RESCALES:
        raise ValueError(f"arm '{name}': unknown rescale '{rescale}' (one of {', '.join(RESCALES)})")
    arm = _parse_base(base, name)
    return Arm(name, arm.fill, arm.selector, arm.random_of, rescale or None)


def _parse_base(base: str, name: str) -> Arm:
    fill, _, rest = base.partition("+")
    if fill not in FILLS:
        raise ValueError(f"arm '{name}': unknown fill '{fill}' (one of {', '.join(FILLS)})")
    if not rest:
        return Arm(name, fill)
    if rest in SELECTORS:
        return Arm(name, fill, selector=rest)
    kind, _, of = rest.partition(":")
    if kind == "random" and of in SELECTORS:
        return Arm(name, fill, random_of=of)
    raise ValueError(f"arm '{name}': unknown selector '{rest}' (one of {', '.join(SELECTORS)}, "
                     f"or random:{'|'.join(SELECTORS)})")


# fill=none hides the filled rows inside the prefill only: a token decoded afterwards reads their unwritten
# late-layer cells (llama.cpp masks cells, not cells per layer). eval needles generates it one prefill per token
# (Session.ridgefill_greedy); agreement's hundreds of steps would each need a prefill, so it refuses it
NONE_FOLLOWS = ("fill 'none' cannot follow a continuation step by step: decode steps after the prefill would read "
                  "the filled rows' unwritten late-layer cells; measure it through the prefill's own logits (eval nll) "
                  "or in eval needles, which generates it one prefill per token")


def parse_arms(names: tuple[str, ...] | list[str], follows: bool = False) -> list[Arm]:
    arms, seen = [], set()
    for name in names:
        arm = parse_arm(name)
        if follows and arm.fill == "none":
            raise ValueError(f"arm '{name}': {NONE_FOLLOWS}")
        if arm.random_of and arm.random_of not in seen:
            raise ValueError(f"arm '{name}' matches the count of a '{arm.random_of}' arm, which must come before it")
        seen.add(arm.selector)
        arms.append(arm)
    return arms


def arm_params(arm: Arm, n_prompt: int, tail: int, sel: SelectorOptions, counts: dict[str, int]) -> dict:
    """Every prefill parameter the arm sets, selectors off unless it uses one (the engine keeps parameters)."""
    # "probe" resets the budget too; a budgeted probe sets "probe_budget" after it
    params = {"fill": arm.fill, "probe": (0, 0), "attention": (sel.query_rows, 0.0, None), "exact_random": (0, 0),
              "exact_rows": [],
              "protected": 0.0, "random_budget": (0.0, 0), "whole_numbers": sel.whole_numbers,
              "blind": bool(arm.selector and arm.selector.startswith("blind-")),
              "rescale": (sel.rescale_rows, arm.rescale in ("values", "both"), arm.rescale in ("keys", "both"))}
    kind = arm.selector.removeprefix("blind-") if arm.selector else None
    if kind == "probe" and sel.probe_share is not None:
        params["probe"] = (sel.probe_rows, int(sel.probe_share * max(n_prompt - tail, 0) + 0.5))
    elif kind == "probe":
        params["probe_budget"] = (sel.probe_rows, sel.budget)
    elif kind == "attention":
        params["attention"] = (sel.query_rows, sel.exact_share, None)
    elif kind == "protected":
        params["protected"] = sel.protected_share
    if arm.random_of:
        params["exact_random"] = (counts[arm.random_of], sel.seed)
    return params


def run_arms(arms: list[Arm], n_prompt: int, tail: int, sel: SelectorOptions,
             prefill: Callable[[Arm, dict], dict]) -> dict[str, dict]:
    """prefill(arm, params) -> stats for every arm in order, a random arm with the count its selector chose on this
    prompt: {arm name: stats}."""
    counts: dict[str, int] = {}
    out = {}
    for arm in arms:
        st = prefill(arm, arm_params(arm, n_prompt, tail, sel, counts))
        if arm.selector:
            counts[arm.selector] = selected(st, arm.selector)
        out[arm.name] = st
    return out


def selected(stats: dict, selector: str) -> int:
    """How many prefix rows a selector made exact, from a prefill's statistics."""
    if selector.endswith("probe"):
        return int(stats.get("n_probe_exact", 0) + stats.get("n_lexical", 0) + stats.get("n_whole_numbers", 0))
    return int(stats.get("n_protected", 0) if selector == "protected" else stats.get("n_attention", 0))
