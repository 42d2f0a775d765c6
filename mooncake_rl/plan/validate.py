"""Routing-table validator: the checks ``prepare`` runs before any byte moves.

It trusts nothing the planner computed except the table itself, and checks it against the
table's own coverage contract (``demands``):

1. records are well formed and name known workers, objects and declared regions, in bounds;
2. every read lies within its object; reads of one object are pairwise disjoint and their
   total equals the size of the union of demanded source bytes (the single-pull invariant;
   with a pull per node, ``PlanParams.pull``, per node: a node's reads of one object are
   disjoint and total the union of what the node's workers demand);
3. no two writes (reads landing, pushes landing) overlap in any region of any worker, and
   demands do not overlap either;
4. every push moves exactly the bytes some earlier write landed at the sender (a read in the
   same or an earlier batch, or a push of an earlier stage), so its source bytes are known;
   a local copy (a push of a worker to itself, :mod:`.sieve`) may move any part of one
   contiguous such write;
5. every write outside staging lands inside one demand and carries exactly the object bytes
   that demand maps to that place (a write either stays inside one demand row, both sides
   advancing by one stride, or steps through demand rows with the demand's own strides);
   per demand, the written bytes equal the demanded bytes.

With 3 and 5, every demanded byte is written exactly once with the right content.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan import grid
from mooncake_rl.plan.table import RoutingTable, demanded_union_bytes

I64 = np.int64
CONTENT_BLOCK = 1 << 20  # writes compared at once (bounds the content check's temporaries)


def validate_routing_table(table: RoutingTable) -> None:
    """Raise :class:`InvariantViolation` naming the first broken invariant, else return.

    The checks are numpy passes that release the GIL, and a 1T MoE's table takes a second
    to check, so they share the work with one other thread (:meth:`_V.run`). One thread,
    not one per check: two cores are all this needs, and each pass's temporaries are the
    size of the table."""
    with ThreadPoolExecutor(1, thread_name_prefix="validate") as side:
        _V(table, side).run()


@dataclass(frozen=True, eq=False)
class _Sorted:
    """Records' (worker, region) keys and the stable order sorting them by (key, dst_offset):
    sorted once, shared by the bounds, overlap, provenance and placement checks."""

    space: np.ndarray
    order: np.ndarray


@dataclass(frozen=True, eq=False)
class _Placement:
    """Writes outside staging (``outside``, or all of them when ``everything``) matched to
    the demand each starts in (``match``, -1: none), with both sides' (worker, region) keys."""

    outside: np.ndarray
    everything: bool
    d_space: np.ndarray
    w_space: np.ndarray
    match: np.ndarray


def _columns(records: np.ndarray) -> dict[str, np.ndarray]:
    """Each field as a contiguous array of the table's own width: ids (worker, region,
    object, stage, batch) stay narrow, so the validator's fresh memory stays near the
    table's size; arithmetic on them goes through ``_space`` or ``grid``, which widen."""
    return {name: np.ascontiguousarray(records[name]) for name in records.dtype.names}


class _V:
    def __init__(self, table: RoutingTable, side: ThreadPoolExecutor) -> None:
        """The pushes' columns are copied on the other thread while this one copies the
        demands' and sorts the declared regions (one per fragment and worker: millions)."""
        self.t, self.side = table, side
        self.n_regions = len(table.regions)
        pushes = side.submit(_columns, table.pushes)
        self.reads, self.demands = _columns(table.reads), _columns(table.demands)
        rs = table.region_sizes
        key = rs["worker"].astype(I64) * self.n_regions + rs["region"]
        order = grid.stable_order(key)
        self.declared, self.declared_size = key[order], rs["size"].astype(I64)[order]
        self.pushes = pushes.result()
        r, p = self.reads, self.pushes
        self.land = {"worker": np.concatenate([r["worker"], p["peer"]])}
        for name in ("dst_region", "dst_offset", "dst_stride", "length", "count"):
            self.land[name] = np.concatenate([r[name], p[name]])

    # -- naming helpers for messages -------------------------------------------------------
    @staticmethod
    def _named(names: tuple[str, ...], i) -> str:
        """``names[i]``, or ``#i`` for an index out of range (a malformed record's)."""
        return names[int(i)] if 0 <= int(i) < len(names) else f"#{int(i)}"

    def _w(self, i) -> str:
        return self._named(self.t.workers, i)

    def _r(self, i) -> str:
        return self._named(self.t.regions, i)

    def _o(self, i) -> str:
        return self._named(self.t.objects, i)

    def _read(self, i) -> str:
        r = self.t.reads[int(i)]
        return (
            f"read #{int(i)} (worker {self._w(r['worker'])}, object {self._o(r['object'])}"
            f"@{int(r['src_offset'])}, {int(r['count'])}x{int(r['length'])} bytes -> "
            f"{self._r(r['dst_region'])}@{int(r['dst_offset'])})"
        )

    def _push(self, i) -> str:
        p = self.t.pushes[int(i)]
        return (
            f"push #{int(i)} (stage {int(p['stage'])}, {self._w(p['worker'])}:"
            f"{self._r(p['src_region'])}@{int(p['src_offset'])} -> {self._w(p['peer'])}:"
            f"{self._r(p['dst_region'])}@{int(p['dst_offset'])}, "
            f"{int(p['count'])}x{int(p['length'])} bytes)"
        )

    def _demand(self, i) -> str:
        d = self.t.demands[int(i)]
        return (
            f"demand #{int(i)} (worker {self._w(d['worker'])}, {self._r(d['dst_region'])}"
            f"@{int(d['dst_offset'])} <- {self._o(d['object'])}@{int(d['src_offset'])}, "
            f"{int(d['count'])}x{int(d['length'])} bytes)"
        )

    def _landing(self, i) -> str:
        n = len(self.t.reads)
        return self._read(i) if i < n else self._push(i - n)

    def _space(self, columns, worker: str = "worker", region: str = "dst_region"):
        return columns[worker].astype(I64) * self.n_regions + columns[region]

    # -- checks ----------------------------------------------------------------------------
    def run(self) -> None:
        """The checks in their documented order; the first broken one is raised.

        Provenance, then the placement of writes in demands (the content check's search),
        run on the other thread beside the bounds and overlap checks. The other thread's
        verdict is only read once the earlier checks passed, so the error raised is the one
        the sequential order gives."""
        if (self.declared[1:] == self.declared[:-1]).any():
            raise InvariantViolation("a worker declares one region twice")
        self.well_formed()
        self.object_bounds()
        sorting = self.side.submit(self._sorted, self.land)
        self.sorted_demands = self._sorted(self.demands)
        self.sorted_land = sorting.result()
        placed = self.side.submit(self._provenance_then_placement)
        self.region_bounds(self.demands, self.sorted_demands, self._demand)
        self.region_bounds(self.land, self.sorted_land, self._landing)
        self.disjoint(self.demands, self.sorted_demands, self._demand, "demands")
        self.disjoint(self.land, self.sorted_land, self._landing, "writes")
        self.single_pull_disjoint()
        union = self._pull_unions()
        self.content_and_coverage(placed.result())
        self.single_pull_total(union)

    def _sorted(self, c) -> _Sorted:
        space = self._space(c)
        return _Sorted(space, grid.lex_order(space, c["dst_offset"]))

    def _provenance_then_placement(self) -> _Placement:
        self.provenance()
        return self.placement()

    def well_formed(self) -> None:
        t = self.t
        n_w, n_o = len(t.workers), len(t.objects)
        for c, describe, fields in (
            (self.reads, self._read, (("worker", n_w), ("object", n_o), ("dst_region", None))),
            (
                self.pushes,
                self._push,
                (("worker", n_w), ("peer", n_w), ("src_region", None), ("dst_region", None)),
            ),
            (self.demands, self._demand, (("worker", n_w), ("object", n_o), ("dst_region", None))),
        ):
            bad = np.zeros(len(c["length"]), bool)
            for name, limit in fields:
                bad |= (c[name] < 0) | (c[name] >= (limit if limit is not None else self.n_regions))
            length, count = c["length"], c["count"]
            bad |= (length <= 0) | (count <= 0) | (c["src_offset"] < 0) | (c["dst_offset"] < 0)
            for stride in (c["src_stride"], c["dst_stride"]):
                bad |= np.where(count == 1, stride != length, stride < length)
            if "stage" in c:
                bad |= (c["stage"] < 1) | (c["stage"] > 2)
            if "batch" in c:
                bad |= c["batch"] < 0
            if bad.any():
                raise InvariantViolation(f"malformed {describe(np.flatnonzero(bad)[0])}")
        # Only a sieved span is pushed into staging, and only by another worker.
        copies = self.pushes["peer"] == self.pushes["worker"]
        for c, describe, into in (
            (self.pushes, self._push, copies),
            (self.demands, self._demand, np.ones(len(self.demands["length"]), bool)),
        ):
            staged = np.flatnonzero(into & (c["dst_region"] == 0))
            if len(staged):
                raise InvariantViolation(f"{describe(staged[0])} targets the staging region")

    def object_bounds(self) -> None:
        r = self.reads
        end = grid.run_ends(r["src_offset"], r["length"], r["count"], r["src_stride"])
        size = self.t.object_sizes[r["object"]]
        past = np.flatnonzero(end > size)
        if len(past):
            i = past[0]
            raise InvariantViolation(
                f"{self._read(i)} reads past the end of its object ({int(end[i])} > "
                f"{int(size[i])} bytes)"
            )

    def region_bounds(self, c, keyed: _Sorted, describe) -> None:
        """Records land in declared regions, inside them (push sources are checked by
        provenance: each must equal a write)."""
        space = keyed.space
        pos = grid.search(self.declared, space, order=keyed.order)
        pos = np.minimum(pos, max(len(self.declared) - 1, 0))
        known = self.declared[pos] == space if len(self.declared) else np.zeros(len(space), bool)
        if not known.all():
            i = np.flatnonzero(~known)[0]
            raise InvariantViolation(
                f"{describe(i)} touches undeclared region {self._r(c['dst_region'][i])} "
                f"of worker {self._w(c['worker'][i])}"
            )
        end = grid.run_ends(c["dst_offset"], c["length"], c["count"], c["dst_stride"])
        size = self.declared_size[pos]
        over = np.flatnonzero(end > size)
        if len(over):
            i = over[0]
            raise InvariantViolation(
                f"{describe(i)} runs past the end of region {self._r(c['dst_region'][i])} "
                f"({int(end[i])} > {int(size[i])} bytes)"
            )

    def disjoint(self, c, keyed: _Sorted, describe, what: str) -> None:
        if len(c["length"]) < 2:
            return
        space, order = keyed.space, keyed.order
        offset, length, count, stride = c["dst_offset"], c["length"], c["count"], c["dst_stride"]
        if ((count == 1) | (stride == length)).all():  # all contiguous: sorted by start
            end = offset + length * count
            s, o, e = space[order], offset[order], end[order]
            hit = np.flatnonzero((s[1:] == s[:-1]) & (o[1:] < e[:-1]))
            pair = None if not len(hit) else (order[hit[0]], order[hit[0] + 1])
        else:
            rects, _ = grid.to_rects(space, offset, length, count, stride)
            hit = grid.first_overlap(grid.to_lanes(rects))
            pair = None if hit is None else tuple(rects.member[x] for x in hit)
        if pair is not None:
            a, b = (int(x) for x in pair)
            raise InvariantViolation(f"{what} overlap: {describe(a)} and {describe(b)}")

    def _pull_domain(self, workers: np.ndarray) -> np.ndarray | None:
        """Node of each worker when the table pulls once per node, else None (one domain)."""
        if self.t.params.pull != "node":
            return None
        return np.asarray(self.t.worker_node, I64)[workers]

    def _pull_unions(self) -> np.ndarray:
        """Bytes each pull domain must read: the union of its demanded source bytes (one
        domain, the table's own union, unless the table pulls once per node)."""
        node = self._pull_domain(self.demands["worker"])
        if node is None:
            return np.array([self.t.unique_demand_bytes], I64)
        unions = np.zeros(len(self.t.nodes), I64)
        order = grid.stable_order(node)
        bounds = np.searchsorted(node[order], np.arange(len(unions) + 1))
        for n in np.flatnonzero(np.diff(bounds)).tolist():
            unions[n] = demanded_union_bytes(self.t.demands[order[bounds[n] : bounds[n + 1]]])
        return unions

    def single_pull_disjoint(self) -> None:
        r = self.reads
        if len(r["length"]) < 2:
            return
        space = r["object"].astype(I64)
        node = self._pull_domain(r["worker"])
        if node is not None:  # one pull per node: reads of different nodes may repeat
            space = node * len(self.t.objects) + space
        rects, _ = grid.to_rects(space, r["src_offset"], r["length"], r["count"], r["src_stride"])
        hit = grid.first_overlap(grid.to_lanes(rects))
        if hit is not None:
            a, b = (int(rects.member[x]) for x in hit)
            raise InvariantViolation(
                f"single-pull violated: {self._read(a)} and {self._read(b)} read the same bytes"
            )

    def provenance(self) -> None:
        """Match every push source to the write that put those bytes at the sender."""
        n_r, p, land = len(self.t.reads), self.pushes, self.land
        sent_from = self._space(p, "worker", "src_region")
        source, exact = grid.at_or_before(
            self.sorted_land.space,
            land["dst_offset"],
            sent_from,
            p["src_offset"],
            ref_order=self.sorted_land.order,
        )
        s = np.maximum(source, 0)
        same = (
            exact
            & (land["dst_stride"][s] == p["src_stride"])
            & (land["length"][s] == p["length"])
            & (land["count"][s] == p["count"])
        )
        # A local copy takes part of one contiguous landing (its source found at or before).
        delta = p["src_offset"] - land["dst_offset"][s]
        inside = (
            (p["peer"] == p["worker"])
            & (source >= 0)
            & (self.sorted_land.space[s] == sent_from)
            & (land["count"][s] == 1)
            & (p["count"] == 1)
            & (delta + p["length"] <= land["length"][s])
        )
        bad = np.flatnonzero(~(same | inside))
        if len(bad):
            raise InvariantViolation(
                f"{self._push(bad[0])} sends bytes no earlier write landed at the sender "
                "(its source is not exactly one read or received push, nor a local copy "
                "of part of one)"
            )
        from_read = source < n_r
        stage = p["stage"]
        src_stage = np.where(from_read, 0, stage[np.maximum(source - n_r, 0)])
        read_batch = np.zeros(len(stage), I64)
        read_batch[from_read] = self.reads["batch"][source[from_read]]
        early = np.where(from_read, (stage == 2) | (read_batch <= p["batch"]), src_stage < stage)
        late = np.flatnonzero(~early)
        if len(late):
            raise InvariantViolation(
                f"{self._push(late[0])} sends bytes before they arrive at the sender "
                f"(from {self._landing(int(source[late[0]]))})"
            )
        # Provenance (object, source offset, source stride) of every landing.
        zeros = np.zeros(len(stage), I64)
        obj = np.concatenate([self.reads["object"], zeros])
        off = np.concatenate([self.reads["src_offset"], zeros])
        stride = np.concatenate([self.reads["src_stride"], zeros])
        for level in (1, 2):
            sel = np.flatnonzero(stage == level)
            src = source[sel]
            obj[sel + n_r], stride[sel + n_r] = obj[src], stride[src]
            off[sel + n_r] = off[src] + np.where(same[sel], 0, delta[sel])
        self.l_obj, self.l_src, self.l_src_stride = obj, off, stride

    def placement(self) -> _Placement:
        """The demand each write outside staging starts in (the last one at or before it)."""
        d, land = self.demands, self.land
        is_outside = land["dst_region"] != 0
        outside = np.flatnonzero(is_outside)
        everything = len(outside) == len(is_outside)
        d_space = self.sorted_demands.space
        w_space, w_off, w_order = self.sorted_land.space, land["dst_offset"], self.sorted_land.order
        if not everything:  # the sorted order kept for the writes outside, renumbered
            w_space, w_off = w_space[outside], w_off[outside]
            w_order = (np.cumsum(is_outside) - 1)[w_order[is_outside[w_order]]]
        match, _ = grid.at_or_before(
            d_space,
            d["dst_offset"],
            w_space,
            w_off,
            ref_order=self.sorted_demands.order,
            query_order=w_order,
        )
        return _Placement(outside, everything, d_space, w_space, match)

    def content_and_coverage(self, placed: _Placement) -> None:
        """Each write lands inside one demand with the right bytes; demands are full.

        The per-write comparison runs in blocks of at most ``CONTENT_BLOCK`` writes, so its
        dozen temporaries do not grow with the table (a 1,000-engine plan has 35M writes),
        alternate blocks on the other thread. Each thread stops at its first wrong write,
        so the earlier of the two is the first in write order."""
        p, n = placed, len(placed.outside)
        size = max(1, -(-n // (2 * max(1, -(-n // (2 * CONTENT_BLOCK))))))  # an even count
        starts = range(0, n, size)
        theirs = self.side.submit(self._contents, p, starts[1::2], size)
        first, got = self._contents(p, starts[0::2], size)
        other, also = theirs.result()
        first, got = min(first, other), got + also
        if first < n:
            i = first if p.everything else int(p.outside[first])
            raise InvariantViolation(
                f"{self._landing(i)} writes bytes no demand maps to that place "
                f"(it carries object {self._o(self.l_obj[i])}@{int(self.l_src[i])})"
            )
        d = self.demands
        need = d["length"] * d["count"]
        short = np.flatnonzero(got.astype(I64) != need)
        if len(short):
            i = short[0]
            raise InvariantViolation(
                f"{self._demand(i)} receives {int(got[i])} of {int(need[i])} bytes "
                "(uncovered or extra bytes)"
            )

    def _contents(self, p: _Placement, starts: range, size: int) -> tuple[int, np.ndarray]:
        """The place among the writes outside staging of the first wrong one in the blocks
        at ``starts`` (all of them: none is wrong), and the bytes each demand receives from
        those blocks (float64: exact below 2**53 bytes per demand)."""
        got = np.zeros(len(self.demands["length"]), np.float64)
        for lo in starts:
            block = slice(lo, lo + size)
            rows = block if p.everything else p.outside[block]
            m = np.maximum(p.match[block], 0)
            ok = (p.match[block] >= 0) & (p.d_space[m] == p.w_space[block])
            written = self._content(m, rows, ok)
            wrong = np.flatnonzero(~ok)
            if len(wrong):
                return lo + int(wrong[0]), got
            got += np.bincount(m, weights=written, minlength=len(got))
        return len(p.outside), got

    def _content(self, m: np.ndarray, rows, ok: np.ndarray) -> np.ndarray:
        """Clear ``ok`` where write ``rows`` do not carry what demand ``m`` maps to their
        place; returns the bytes each writes."""
        d, land = self.demands, self.land
        w_off = land["dst_offset"][rows]
        l_len, l_cnt, l_dst_stride = (land[k][rows] for k in ("length", "count", "dst_stride"))
        l_obj, l_src, l_src_stride = (a[rows] for a in (self.l_obj, self.l_src, self.l_src_stride))
        rel = w_off - d["dst_offset"][m]
        dd = {
            name: d[name][m]
            for name in ("dst_stride", "length", "count", "src_offset", "src_stride", "object")
        }
        extent = (l_cnt - 1) * np.where(l_cnt > 1, l_dst_stride, 0) + l_len
        # The demand maps byte ``col`` of its row ``row`` to object byte
        # ``src_offset + row * src_stride + col``. A write is right when its first byte
        # carries that object byte and its later rows follow the same map: either it stays
        # inside that one demand row and both sides advance by the same stride (a pitch
        # smaller than the demand's row, as when another consumer splits the row finer),
        # or it steps through demand rows exactly as the demand does.
        stride = np.maximum(dd["dst_stride"], 1)
        row, col = rel // stride, rel % stride
        ok &= l_obj == dd["object"]
        ok &= l_src == dd["src_offset"] + row * dd["src_stride"] + col
        in_row = (
            (row < dd["count"])
            & (col + extent <= dd["length"])
            & ((l_cnt == 1) | (l_dst_stride == l_src_stride))
        )
        row_aligned = (
            (col + l_len <= dd["length"])
            & (row + l_cnt <= dd["count"])
            & (l_dst_stride == dd["dst_stride"])
            & (l_src_stride == dd["src_stride"])
        )
        ok &= in_row | row_aligned
        return l_len * l_cnt

    def single_pull_total(self, union: np.ndarray) -> None:
        """``union``: what each pull domain must read (:meth:`_pull_unions`)."""
        nbytes = self.reads["length"].astype(I64) * self.reads["count"]
        node = self._pull_domain(self.reads["worker"])
        total = np.array([nbytes.sum()]) if node is None else np.bincount(node, nbytes, len(union))
        short = np.flatnonzero(total.astype(I64) != union)
        if len(short):
            n = int(short[0])
            where = "" if node is None else f" on node {self.t.nodes[n]}"
            raise InvariantViolation(
                f"single-pull violated: reads{where} move {int(total[n])} bytes but the union "
                f"of demanded source bytes{where} is {int(union[n])}"
            )
