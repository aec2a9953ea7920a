"""Near-identical profiles ("clones") merged into one optimistic profile: a relaxation of a chain's multiset walk.

A catalog with many fine-tuned or re-quantised copies of a model (the hard family `chain_clones`: 20-40 clones
within 1-2% of each other) gives the chain walk (`chain.walk_chain`) thousands of multisets of new instances that
differ only in which clone each instance is, and their bounds differ by a fraction of a percent. Its frontier then
moves slowly (measured: chain_clones 1201025, 139,000 heap entries and 6.6 s to prove; 1181017 unproven at 2 s with a
gap of 20%, its optimum 13% below the incumbent).

Here the profiles of a workflow's relaxation (`milp.RelaxedModel`) are grouped (`clone_groups`: the same GPUs,
replicas and stages, memory, capacity and every stage's latency within CLONE_TOL of each other), and each group
becomes one profile that is at least as good as each member: the least memory, the largest capacity, each stage's
least latency, the fewest replicas, in a room row (`milp.room_rows`) only when every member is. Every variant maps to
a multiset of groups (its image) whose relaxed cost is at most its own (a point counts at least the relaxation's
memory floor, which bounds every variant while a group's memory only bounds its members'), so the same walk over groups
(`AggregatedModel`; `walk_chain` sees `relaxed`) gives:

- a lower bound of every variant's cost (its least bound over the groups' multisets);
- candidates: each settled packing is mapped back to members (`AggregatedModel.realize`) and checked as a variant;
- when it completes, the images that can still beat the incumbent (`Images`): the multiset walk over the profiles
  then skips every multiset whose image is not one of them, or below one of them for an expansion.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from flowmaker.selection.problem import INF, NEW, REUSE, leq

if TYPE_CHECKING:
    from flowmaker.selection.milp import Choice, RelaxedModel

# Relative spread of memory, capacity and each latency within a group. The hard family's clones differ by a factor
# within +-1% (pairwise up to 2%). Measured on chain_clones seeds 1181000, 1217000 and 1231000 (60 each): 0.01, 0.02 and
# 0.03 proved the same instances within 1 s (56, 58, 56); 0.005 left 1181017 unproven at 17.8%.
CLONE_TOL = 0.02
IMAGE_SLACK = 1e-7  # images kept up to the incumbent times (1 + this): more than the walks' own 1e-9 and float noise
BELOW_MOST = 50_000  # images below some kept image, at most (past it expansions are not filtered; ~15 MB)


def clone_groups(model: RelaxedModel) -> list[list[int]] | None:
    """The new-instance profiles of the model's options, grouped (module docstring); each group sorted by memory
    (then index). None when no group has two members (nothing to merge)."""
    pb = model.pb
    lat, buckets = profile_buckets(pb, model.pw.llm, model.opts)
    groups: list[list[int]] = []
    for ps in buckets.values():
        ps.sort(key=lambda p: (pb.p_mem[p], p))
        cur: list[int] = []
        for p in ps:
            if cur and all(_near(pb.p_mem[p], pb.p_mem[q]) and _near(pb.p_cap[p], pb.p_cap[q])
                           and all(_near(lat[p][j], lat[q][j]) for j in lat[p]) for q in cur):
                cur.append(p)
                continue
            if cur:
                groups.append(cur)
            cur = [p]
        if cur:
            groups.append(cur)
    if all(len(g) < 2 for g in groups):
        return None
    return sorted(groups)


def profile_buckets(pb: Any, llm: Sequence[int], opts: Mapping[int, Sequence[tuple[str, int, float]]]
                    ) -> tuple[dict[int, dict[int, float]], dict[tuple[Any, ...], list[int]]]:
    """(per new-instance profile of the options, its least latency bound per LLM stage; those profiles by what any
    group's members share: replicas, GPUs per replica and in all, and the stages that may use them), each bucket in
    profile order."""
    lat: dict[int, dict[int, float]] = {}
    for s in llm:
        for k, ref, v in opts[s]:
            if k == NEW:
                got = lat.setdefault(ref, {})
                got[s] = min(v, got.get(s, INF))
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for pi in sorted(lat):
        buckets.setdefault((pb.p_reps[pi], pb.p_k[pi], pb.p_gpus[pi], frozenset(lat[pi])), []).append(pi)
    return lat, buckets


def _near(a: float, b: float, tol: float = CLONE_TOL) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b))


class AggregatedModel:
    """The walk's view of a `milp.RelaxedModel` with each group of clones one optimistic profile (its first
    member's index stands for it). Floors and HiGHS models are the original's: they bound every variant."""

    relaxed = True  # `chain.walk_chain`: bounds and candidates, no tie-break proof, no placement pruning

    def __init__(self, model: RelaxedModel, groups: list[list[int]]) -> None:
        pb = model.pb
        self.base = model
        self.groups = groups
        self.pw = model.pw
        self.ok = model.ok
        p_mem, p_cap, p_reps = list(pb.p_mem), list(pb.p_cap), list(pb.p_reps)
        self.rep_of: dict[int, int] = {}
        self.members: dict[int, list[int]] = {}
        for g in groups:
            r = g[0]
            p_mem[r] = min(pb.p_mem[p] for p in g)
            p_cap[r] = max(pb.p_cap[p] for p in g)
            p_reps[r] = min(pb.p_reps[p] for p in g)
            self.members[r] = g
            for p in g:
                self.rep_of[p] = r
        if pb.sharing:
            # the barred GPUs from the request's own numbers, carried into the copy (from the representatives'
            # optimistic ones a new instance could look busier than a member's, and bar more)
            from flowmaker.selection.sharing_alone import barred

            barred(pb)
        view = copy.copy(pb)  # the same problem with the representatives' numbers optimistic
        view.p_mem, view.p_cap, view.p_reps = tuple(p_mem), tuple(p_cap), tuple(p_reps)
        self.pb = view
        self.opts: dict[int, list[tuple[str, int, float]]] = {}
        self.serves: dict[int, dict[int, float]] = {}  # per stage: its members' latencies
        for s, ol in model.opts.items():
            o2 = [o for o in ol if o[0] == REUSE]
            least: dict[int, float] = {}
            self.serves[s] = {}
            for k, ref, v in ol:
                if k == NEW:
                    r = self.rep_of[ref]
                    least[r] = min(least.get(r, INF), v)
                    self.serves[s][ref] = v
            o2 += [(NEW, r, v) for r, v in sorted(least.items())]
            self.opts[s] = o2
        self.room = [([g[0] for g in groups if all(p in set(members) for p in g)], cap) for members, cap in model.room]
        self._m_floor: float | None = None

    def least_memory_lp(self) -> float:
        if self._m_floor is None:
            self._m_floor = self.base.least_memory_lp()
        return self._m_floor

    def _solve(self, *args: Any, **kw: Any) -> tuple[str, float, list[float]]:
        return self.base._solve(*args, **kw)

    @contextmanager
    def without_share_rows(self) -> Iterator[None]:
        with self.base.without_share_rows():
            yield

    def realize(self, assign: dict[int, tuple[str, int]], inst: dict[int, int]
                ) -> tuple[tuple[float, float, int], list[Choice], list[int], list[tuple[str, tuple[str, ...]]]] | None:
        """A variant from a packing of the groups: each group instance becomes the member that serves all its stages
        with room for their load, of least memory (then least latency), or of least latency; the better of the two
        that place (`RelaxedModel.realize` checks everything). None when neither places."""
        pb, pw = self.base.pb, self.pw
        by_inst: dict[tuple[int, int], list[int]] = {}
        for s in pw.llm:
            k, ref = assign[s]
            if k == NEW:
                by_inst.setdefault((ref, inst[s]), []).append(s)
        best = None
        for by_lat in (False, True):
            a2 = dict(assign)
            i2: dict[int, int] = {}
            count: dict[int, int] = {}
            for (rep, _b), st in sorted(by_inst.items()):
                load = sum(pw.load[s] for s in st)
                pick, key = None, (INF, INF)
                for p in self.members.get(rep, [rep]):
                    if not all(p in self.serves[s] for s in st) or not leq(load, pb.p_cap[p]):
                        continue
                    lat = sum(self.serves[s][p] for s in st)
                    k_ = (lat, pb.p_mem[p]) if by_lat else (pb.p_mem[p], lat)
                    if k_ < key:
                        pick, key = p, k_
                if pick is None:
                    break
                c = count.get(pick, 0)
                count[pick] = c + 1
                for s in st:
                    a2[s] = (NEW, pick)
                    i2[s] = c
            else:
                got = self.base.realize(a2, i2)
                if got is not None and (best is None or got[0] < best[0]):
                    best = got
        return best

    def images(self, settled: dict[tuple[int, ...], float], inc: float, profs: list[int]) -> Images:
        """The images worth a look once the walk over groups completed with incumbent `inc`: its settled multisets
        (representatives' indices) of bound at most inc (1 + IMAGE_SLACK), by group counts, for the walk over
        `profs` (the concrete walk's profiles, in its order)."""
        reps = sorted(self.members) + sorted({self.rep_of.get(p, p) for p in profs} - set(self.members))
        gid = {r: i for i, r in enumerate(reps)}
        keep: dict[tuple[int, ...], float] = {}
        for ys, v in settled.items():
            if v <= inc * (1 + IMAGE_SLACK):
                cnt = [0] * len(reps)
                for r in ys:
                    cnt[gid[r]] += 1
                t = tuple(cnt)
                keep[t] = min(v, keep.get(t, INF))
        return Images([gid[self.rep_of.get(p, p)] for p in profs], keep)


class Images:
    """Which multisets of the concrete walk may still beat its incumbent: those whose image (counts per group) is
    kept, with its bound (a floor of theirs); an expansion only when its image is at or below a kept one."""

    def __init__(self, gid: list[int], keep: dict[tuple[int, ...], float]) -> None:
        self.gid = gid  # group of each profile position of the walk
        self.n = max(gid, default=-1) + 1
        self.keep = keep
        below: set[tuple[int, ...]] | None = set()
        for t in keep:
            if below is None:
                break
            stack = [t]
            while stack:
                u = stack.pop()
                if u in below:
                    continue
                below.add(u)
                if len(below) > BELOW_MOST:
                    below = None
                    break
                for g, c in enumerate(u):
                    if c:
                        stack.append((*u[:g], c - 1, *u[g + 1:]))
        self.below = below

    def of(self, y: tuple[int, ...]) -> list[int]:
        out = [0] * self.n
        for q, c in enumerate(y):
            if c:
                out[self.gid[q]] += c
        return out

    def floor(self, img: tuple[int, ...]) -> float:
        """A floor of the point of every multiset with this image (math.inf: not kept, none can beat the
        incumbent)."""
        return self.keep.get(img, math.inf)

    def may_grow(self, img: tuple[int, ...]) -> bool:
        return self.below is None or img in self.below
