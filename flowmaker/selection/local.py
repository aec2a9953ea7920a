"""Local search around an incumbent: the anytime answer `exact` improves before its bounds take over.

Used by `milp.select_hybrid` when the first branch and bound did not settle a request. A variant is seen as
each LLM stage on a running instance or on a "bin" (a new instance of some profile). A move closes a bin (its
stages, or all stages, heaviest first to the fastest options with room), merges a bin into another bin or a
running instance, changes the profile of a bin, moves one stage (another running instance, another bin, a bin
of its own of any usable profile), or swaps the options of two stages. Every candidate is numbered in the
spec's order (bins by first stage) and checked from scratch (`Problem.check`: capacity and the spec's
placement), then scored (`Problem.score`); the first move that is better in the spec's order (cost, L, new
GPUs) is taken and the scan starts again. It changes no bound and proves nothing: a better incumbent only
shrinks the gap of an unsettled answer and lets the bounds prune earlier. The work is capped by counts
(full checks, cheap evaluations), never by the clock, so its result does not depend on the machine's load;
the caller's deadline still ends it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from flowmaker.selection.problem import INF, NEW, REL_TOL, REUSE, Choice, Problem, PWorkflow, better, leq

# Work caps (counts, not time): full checks (capacity + placement) and cheap latency/memory evaluations. Measured on
# chain_clones: 300 checks keep most of what 1,500 find, in a fifth of the time (0.03-0.15 s).
LOCAL_CHECKS = 300
LOCAL_EVALS = 6_000

Found = tuple[tuple[float, float, int], tuple[PWorkflow, list[Choice], list[int], list[tuple[str, tuple[str, ...]]]]]


def _number(assign: Sequence[tuple[str, int]], bin_prof: dict[int, int]) -> tuple[list[Choice], list[int]]:
    """(choice, slot profiles) in the spec's numbering: bins by their first stage, empty bins dropped."""
    choice: list[Choice] = []
    slots: list[int] = []
    num: dict[int, int] = {}
    for kind, ref in assign:
        if kind == REUSE:
            choice.append((REUSE, ref))
            continue
        if ref not in num:
            num[ref] = len(slots)
            slots.append(bin_prof[ref])
        choice.append((NEW, num[ref]))
    return choice, slots


def improve(pb: Problem, found: Found, usable: Sequence[bool], deadline: float = INF,
            max_checks: int = LOCAL_CHECKS, max_evals: int = LOCAL_EVALS) -> Found:
    """The incumbent `found` improved by first-improvement moves (module docstring) until no move helps, the
    work caps are spent or the deadline passes. Returns `found` itself when nothing better was found."""
    score, (pw, choice0, slots0, _) = found
    best = score
    best_at = found[1]
    lam = pb.lam
    llm = pw.llm
    # Options of each stage alone: running instances and profiles that meet accuracy, latency and capacity.
    r_opts = [[r for r, pi in enumerate(pb.r_prof) if pb.p_ok[pi] and leq(pw.lat_reuse[s][r], lam)
               and leq(pb.r_load0[r] + pw.load[s], pb.p_cap[pi])] for s in llm]
    n_opts = [[pi for pi in range(len(pb.profiles)) if usable[pi] and leq(pw.lat_new[s][pi], lam)
               and leq(pw.load[s], pb.p_cap[pi])] for s in llm]
    # Profiles by cost of the bin for a stage: cheap-and-fast first, like the branch and bound.
    for j, s in enumerate(llm):
        n_opts[j].sort(key=lambda pi: (pb.p_mem[pi] * pw.lat_new[s][pi], pi))
    assign: list[tuple[str, int]] = [(k, ref) for k, ref in choice0]
    bin_prof: dict[int, int] = dict(enumerate(slots0))
    checks = evals = 0
    tool_lat, lat_reuse, lat_new, p_mem = pw.tool_lat, pw.lat_reuse, pw.lat_new, pb.p_mem

    def repack(b: int, order: list[int], ru: dict[int, float], bu: dict[int, float]
               ) -> list[tuple[str, int]] | None:
        """Bin b closed: the stages `order` (in this order) each to its fastest running instance or other bin
        with room; `ru` / `bu` hold the load already on them (of the stages that stay). None: one has no room."""
        others = sorted({ref for k, ref in assign if k == NEW and ref != b})
        moved = list(assign)
        for j in order:
            s, ld = llm[j], pw.load[llm[j]]
            opts = [(pw.lat_reuse[s][r], 0, r) for r in r_opts[j]
                    if leq(pb.r_load0[r] + ru.get(r, 0.0) + ld, pb.p_cap[pb.r_prof[r]])]
            opts += [(pw.lat_new[s][bin_prof[c]], 1, c) for c in others
                     if leq(bu.get(c, 0.0) + ld, pb.p_cap[bin_prof[c]])]
            if not opts:
                return None
            _, kind, ref = min(opts)
            if kind == 0:
                ru[ref] = ru.get(ref, 0.0) + ld
                moved[j] = (REUSE, ref)
            else:
                bu[ref] = bu.get(ref, 0.0) + ld
                moved[j] = (NEW, ref)
        return moved

    def close_bins(bins: list[int]) -> Iterator[tuple[list[tuple[str, int]], dict[int, int]]]:
        """Each bin closed: its stages, heaviest first, to the fastest options with room (several stages move at
        once, which no single move does when each alone raises the latency); or every stage again, heaviest
        first (room for the closed bin's stages is often made by moving others)."""
        r_used: dict[int, float] = {}
        b_used: dict[int, float] = {}
        for j, (k, ref) in enumerate(assign):
            d = r_used if k == REUSE else b_used
            d[ref] = d.get(ref, 0.0) + pw.load[llm[j]]
        heavy_first = sorted(range(len(llm)), key=lambda j: -pw.load[llm[j]])
        for b in bins:
            members = [j for j in heavy_first if assign[j] == (NEW, b)]
            for got in (repack(b, members, dict(r_used), dict(b_used)), repack(b, heavy_first, {}, {})):
                if got is not None:
                    yield got, bin_prof

    def moves() -> Iterator[tuple[list[tuple[str, int]], dict[int, int]]]:
        bins = sorted({ref for k, ref in assign if k == NEW})
        fresh = max(bin_prof, default=-1) + 1
        yield from close_bins(bins)
        # Whole bins: merging or re-profiling a bin is what lowers the memory.
        for b in bins:
            members = [j for j, (k, ref) in enumerate(assign) if k == NEW and ref == b]
            for c in bins:
                if c != b:
                    yield [(NEW, c) if j in members else a for j, a in enumerate(assign)], bin_prof
            common = set(r_opts[members[0]]).intersection(*(r_opts[j] for j in members[1:]))
            for r in sorted(common):
                yield [(REUSE, r) if j in members else a for j, a in enumerate(assign)], bin_prof
            profs = set(n_opts[members[0]]).intersection(*(n_opts[j] for j in members[1:]))
            for pi in sorted(profs, key=lambda p: (pb.p_mem[p], p)):
                if pi != bin_prof[b]:
                    yield assign, {**bin_prof, b: pi}
        for j in range(len(llm)):
            cur = assign[j]
            for r in r_opts[j]:
                if (REUSE, r) != cur:
                    yield [*assign[:j], (REUSE, r), *assign[j + 1:]], bin_prof
            for b in bins:
                if (NEW, b) != cur:
                    yield [*assign[:j], (NEW, b), *assign[j + 1:]], bin_prof
            for pi in n_opts[j]:
                yield [*assign[:j], (NEW, fresh), *assign[j + 1:]], {**bin_prof, fresh: pi}
        # Two stages trade places (capacity may allow the pair where neither move alone fits).
        for j in range(len(llm)):
            for i in range(j + 1, len(llm)):
                if assign[i] != assign[j]:
                    sw = list(assign)
                    sw[i], sw[j] = assign[j], assign[i]
                    yield sw, bin_prof

    improved = True
    while improved and checks < max_checks and evals < max_evals:
        improved = False
        for cand, bp in moves():
            if checks >= max_checks or evals >= max_evals or time.perf_counter() > deadline:
                break
            evals += 1
            # Cheap first: memory times the latency without GPU sharing's slowdown (a lower bound of the cost), read
            # off the move itself (the same sums, in the same order, as from its numbered choice).
            stage_lat = list(tool_lat)
            mem = 0.0
            seen: set[int] = set()
            for s, (k, ref) in zip(llm, cand, strict=True):
                if k == REUSE:
                    stage_lat[s] = lat_reuse[s][ref]
                else:
                    pi = bp[ref]
                    stage_lat[s] = lat_new[s][pi]
                    if ref not in seen:
                        seen.add(ref)
                        mem += p_mem[pi]
            lat = pb.longest_path(pw, stage_lat)
            if mem * lat > best[0] * (1 + REL_TOL) or not leq(lat, lam):
                continue
            choice, slots = _number(cand, bp)
            checks += 1
            code, places = pb.check(pw, choice, slots)
            if code != 5:
                continue
            sc = pb.score(pw, choice, slots, places)
            if better(*sc, best):
                best, best_at = sc, (pw, choice, slots, list(places))
                assign = list(cand)
                bin_prof = {b: p for b, p in bp.items() if any(k == NEW and ref == b for k, ref in assign)}
                improved = True
                break
    if best_at is found[1]:
        return found
    return best, best_at
