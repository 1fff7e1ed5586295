"""Stages 1 and 2 of the allocator: split one group's GPUs and NICs between A and F.

Per group, with unit times from `costmodel.UnitTimes` (seconds per sequence per layer on one
GPU / one NIC: a, f for compute, c_a, c_f for the wire), choose integers

    m + n = W_g   (attention GPUs, FFN GPUs)      M_a + M_f = N_g   (attention, FFN NICs)

Stage 1 minimises the per-sequence stage time  tau = max(a/m, c_a/M_a, f/n, c_f/M_f).
With u = 1/tau this is linear:  m >= a*u, n >= f*u, M_a >= c_a*u, M_f >= c_f*u, max u.

Stage 2 keeps every configuration whose tau is within (1 + eps) of the optimum — by integer
lower bounds m >= ceil(a / (tau*(1+eps))) etc. — and maximises the smaller of the two
components' compute utilisations (a/m)/tau and (f/n)/tau, i.e. minimises max(m/a, n/f).
That objective does not see the NIC split, so among its ties (same m, n) the split with the
smallest tau is taken (`best_nic_split`): the plan leaves the Stage 1 optimum only by what its
GPU split costs, and never by more than the band.
See docs/planner.md for why the design's "maximise I_attn + I_ffn" needs this form.

Optional constraints of the full (non-roofline) problem:
* NIC locality: a component cannot use more NICs than its GPUs have: M_a <= r*m, M_f <= r*n;
* n <= num_experts (an FFN shard holds at least one whole expert; experts are not replicated);
* FFN memory: (A + B*m)/n <= cap, linear as cap*n - B*m >= A (see `Planner.ffn_terms`).

`solve_milp` uses HiGHS through `scipy.optimize.milp`; `solve_enumerate` checks every integer
point and is the reference the tests compare against.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

BINDING_NAMES = ("attention compute", "attention NICs", "FFN compute", "FFN NICs")


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitProblem:
    """One group's allocation problem (see module docstring for the symbols)."""

    gpus: int  # W_g
    nics: int  # N_g: NICs the group's two components share (half of the group's NICs)
    attn_gpu: float  # a
    ffn_gpu: float  # f
    attn_nic: float  # c_a
    ffn_nic: float  # c_f
    nics_per_gpu: float | None = None  # r; None disables the locality constraint
    max_ffn_gpus: int | None = None
    max_attn_gpus: int | None = None  # the replicas a global batch of micro-batches can feed
    ffn_mem: tuple[float, float, float] | None = None  # (A, B, cap) in bytes

    def tau(self, m: int, n: int, ma: int, mf: int) -> float:
        return max(self.attn_gpu / m, self.ffn_gpu / n, self.attn_nic / ma, self.ffn_nic / mf)

    def terms(self, m: int, n: int, ma: int, mf: int) -> tuple[float, float, float, float]:
        return (self.attn_gpu / m, self.attn_nic / ma, self.ffn_gpu / n, self.ffn_nic / mf)


@dataclass(frozen=True, kw_only=True, slots=True)
class Split:
    m: int
    n: int
    attn_nics: int
    ffn_nics: int
    tau: float  # seconds per sequence per layer (stage 1 objective at this point)
    tau_opt: float  # the stage 1 optimum
    balance: float  # stage 2 objective max(m/a, n/f) (smaller is better)
    binding: str  # which stage-1 term sets tau_opt
    solver: str


def _band_bounds(p: SplitProblem, tau_opt: float, eps: float) -> tuple[int, int, int, int]:
    """Integer lower bounds on m, n, M_a, M_f that keep tau <= tau_opt*(1+eps)."""
    limit = tau_opt * (1.0 + eps)

    def lb(unit: float) -> int:
        return max(1, math.ceil(unit / limit * (1.0 - 1e-12)))

    return lb(p.attn_gpu), lb(p.ffn_gpu), lb(p.attn_nic), lb(p.ffn_nic)


def _binding(p: SplitProblem, m: int, n: int, ma: int, mf: int) -> str:
    terms = p.terms(m, n, ma, mf)
    return BINDING_NAMES[int(np.argmax(terms))]


def _check_basic(p: SplitProblem) -> None:
    if p.gpus < 2:
        raise ValueError(
            f"GPUs per group: {p.gpus} < 2 — each group needs one attention and one FFN GPU; "
            "use more GPUs or fewer groups"
        )
    if p.nics < 2:
        raise ValueError(
            f"NICs per group: the group's share of NICs ({p.nics}) is < 2 — each component "
            "needs one; use more NICs per node or fewer groups"
        )


# ------------------------------------------------------------------------------- MILP


def _constraints(p: SplitProblem) -> list[LinearConstraint]:
    """Rows over x = [m, n, M_a, M_f, t] shared by both stages (t is stage-specific)."""
    rows: list[list[float]] = [[1, 1, 0, 0, 0], [0, 0, 1, 1, 0]]
    lo: list[float] = [p.gpus, p.nics]
    hi: list[float] = [p.gpus, p.nics]
    if p.nics_per_gpu is not None:
        r = p.nics_per_gpu
        rows += [[r, 0, -1, 0, 0], [0, r, 0, -1, 0]]
        lo += [0.0, 0.0]
        hi += [np.inf, np.inf]
    if p.ffn_mem is not None:
        a, b, cap = p.ffn_mem
        rows.append([-b / cap, 1.0, 0, 0, 0])
        lo.append(a / cap)
        hi.append(np.inf)
    return [LinearConstraint(np.array(rows, dtype=float), np.array(lo), np.array(hi))]


def _bounds(p: SplitProblem, lower: tuple[int, int, int, int] = (1, 1, 1, 1)) -> Bounds:
    n_hi = p.gpus - 1 if p.max_ffn_gpus is None else min(p.gpus - 1, p.max_ffn_gpus)
    m_hi = p.gpus - 1 if p.max_attn_gpus is None else min(p.gpus - 1, p.max_attn_gpus)
    lb = [lower[0], lower[1], lower[2], lower[3], 0.0]
    ub = [m_hi, n_hi, p.nics - 1, p.nics - 1, np.inf]
    return Bounds(np.array(lb, dtype=float), np.array(ub, dtype=float))


def _run(
    c: np.ndarray,
    cons: list[LinearConstraint],
    bounds: Bounds,
    time_limit_s: float,
    mip_gap: float,
) -> tuple[int, int, int, int] | None:
    res = milp(
        c,
        constraints=cons,
        integrality=np.array([1, 1, 1, 1, 0]),
        bounds=bounds,
        options={"time_limit": time_limit_s, "mip_rel_gap": mip_gap, "disp": False},
    )
    if res.x is None:
        return None
    m, n, ma, mf = (round(float(v)) for v in res.x[:4])
    return m, n, ma, mf


def solve_milp(
    p: SplitProblem, *, eps: float = 0.02, time_limit_s: float = 1.0, mip_gap: float = 1e-6
) -> Split:
    """Stages 1 and 2 with HiGHS. Raises ValueError naming the binding constraint if none fits."""
    _check_basic(p)
    scale = max(p.attn_gpu, p.ffn_gpu, p.attn_nic, p.ffn_nic)
    units = [p.attn_gpu / scale, p.ffn_gpu / scale, p.attn_nic / scale, p.ffn_nic / scale]
    # stage 1: max u  s.t.  x_i - unit_i * u >= 0
    cons = _constraints(p)
    rows = np.zeros((4, 5))
    for i, unit in enumerate(units):
        rows[i, i] = 1.0
        rows[i, 4] = -unit
    cons.append(LinearConstraint(rows, np.zeros(4), np.full(4, np.inf)))
    x1 = _run(np.array([0, 0, 0, 0, -1.0]), cons, _bounds(p), time_limit_s, mip_gap)
    if x1 is None:
        raise ValueError(explain_infeasible(p))
    tau_opt = p.tau(*x1)
    # stage 2: min w  s.t.  w - x_i / unit_i >= 0 for the two GPU counts, inside the band
    lower = _band_bounds(p, tau_opt, eps)
    cons = _constraints(p)
    rows = np.array([[-1.0 / units[0], 0, 0, 0, 1.0], [0, -1.0 / units[1], 0, 0, 1.0]])
    cons.append(LinearConstraint(rows, np.zeros(2), np.full(2, np.inf)))
    x2 = _run(np.array([0, 0, 0, 0, 1.0]), cons, _bounds(p, lower), time_limit_s, mip_gap)
    m, n, ma, mf = x2 if x2 is not None else x1  # x1 is always inside the band
    ma, mf = best_nic_split(p, m, n, ma)
    return Split(
        m=m,
        n=n,
        attn_nics=ma,
        ffn_nics=mf,
        tau=p.tau(m, n, ma, mf),
        tau_opt=tau_opt,
        balance=max(m / p.attn_gpu, n / p.ffn_gpu),
        binding=_binding(p, *x1),
        solver="milp",
    )


def best_nic_split(p: SplitProblem, m: int, n: int, fallback: int) -> tuple[int, int]:
    """The NIC split (M_a, M_f) with the smallest tau for the GPU split (m, n).

    Stage 2's objective involves only m and n, so any NIC split inside the band ties; this
    takes the fastest (ties: the one closest to `fallback`), so the plan sits at the Stage 1
    optimum whenever its GPU split allows it rather than anywhere in the band."""
    best, best_key = (fallback, p.nics - fallback), (p.tau(m, n, fallback, p.nics - fallback), 0)
    r = p.nics_per_gpu
    for ma in range(1, p.nics):
        mf = p.nics - ma
        if r is not None and (ma > r * m + 1e-9 or mf > r * n + 1e-9):
            continue
        key = (p.tau(m, n, ma, mf), abs(ma - fallback))
        if key < best_key:
            best, best_key = (ma, mf), key
    return best


# ------------------------------------------------------------------------ enumeration


def _grid(p: SplitProblem) -> tuple[np.ndarray, ...]:
    """Every integer (m, M_a) point as broadcast arrays m, n, M_a, M_f and the feasible mask."""
    m = np.arange(1, p.gpus, dtype=float)[:, None]
    ma = np.arange(1, p.nics, dtype=float)[None, :]
    n, mf = p.gpus - m, p.nics - ma
    ok = np.ones((m.size, ma.size), dtype=bool)
    if p.max_ffn_gpus is not None:
        ok &= n <= p.max_ffn_gpus
    if p.max_attn_gpus is not None:
        ok &= m <= p.max_attn_gpus
    if p.nics_per_gpu is not None:
        ok &= (ma <= p.nics_per_gpu * m + 1e-9) & (mf <= p.nics_per_gpu * n + 1e-9)
    if p.ffn_mem is not None:
        a, b, cap = p.ffn_mem
        ok &= a + b * m <= cap * n * (1 + 1e-12)
    return m, n, ma, mf, ok


def _point(p: SplitProblem, flat: int, cols: int) -> tuple[int, int, int, int]:
    i, j = divmod(flat, cols)
    return i + 1, p.gpus - i - 1, j + 1, p.nics - j - 1


def solve_enumerate(p: SplitProblem, *, eps: float = 0.02) -> Split:
    """Exhaustive reference for `solve_milp`: same stages, every integer point."""
    _check_basic(p)
    m, n, ma, mf, ok = _grid(p)
    if not ok.any():
        raise ValueError(explain_infeasible(p))
    tau = np.maximum(
        np.maximum(p.attn_gpu / m, p.ffn_gpu / n), np.maximum(p.attn_nic / ma, p.ffn_nic / mf)
    )
    tau = np.where(ok, tau, np.inf)
    x1 = _point(p, int(np.argmin(tau)), tau.shape[1])
    tau_opt = p.tau(*x1)
    lm, ln, lma, lmf = _band_bounds(p, tau_opt, eps)
    band = ok & (m >= lm) & (n >= ln) & (ma >= lma) & (mf >= lmf)
    balance = np.where(band, np.maximum(m / p.attn_gpu, n / p.ffn_gpu), np.inf)
    # ties on balance (every NIC split of one GPU split): the smallest tau
    flat2 = int(np.lexsort((np.broadcast_to(tau, balance.shape).ravel(), balance.ravel()))[0])
    x2 = _point(p, flat2, balance.shape[1])
    return Split(
        m=x2[0],
        n=x2[1],
        attn_nics=x2[2],
        ffn_nics=x2[3],
        tau=p.tau(*x2),
        tau_opt=tau_opt,
        balance=float(balance.flat[flat2]),
        binding=_binding(p, *x1),
        solver="enumerate",
    )


def explain_infeasible(p: SplitProblem) -> str:
    """Name the first constraint family that empties the feasible set."""
    _check_basic(p)
    ffn_most = p.gpus if p.max_ffn_gpus is None else p.max_ffn_gpus
    if p.max_attn_gpus is not None and p.max_attn_gpus + ffn_most < p.gpus:
        return (
            f"batch: {p.max_attn_gpus} micro-batches per step feed at most {p.max_attn_gpus} "
            f"attention replicas and {p.max_ffn_gpus} experts at most as many shards, fewer than "
            f"the group's {p.gpus} GPUs; give more micro-batches or use more groups"
        )
    if not _grid(dataclasses.replace(p, ffn_mem=None))[-1].any():
        r = p.nics_per_gpu
        if r is None:
            return "no split gives both components a GPU and a NIC (unexpected; please report)"
        return (
            f"NIC locality: with {r:g} NICs per GPU, a group of {p.gpus} GPUs cannot give both "
            f"components a NIC of their own out of its {p.nics}; use more GPUs per group or "
            "fewer groups"
        )
    if p.ffn_mem is not None and not _grid(p)[-1].any():
        cap = p.ffn_mem[2]
        return (
            f"FFN memory: no split of {p.gpus} GPUs per group holds an expert shard's states "
            f"and activations in {cap / 2**30:.1f} GiB; use more GPUs, a shorter sequence, a "
            "smaller micro-batch or (if off) --recompute full"
        )
    return "no feasible split (unexpected; please report)"
