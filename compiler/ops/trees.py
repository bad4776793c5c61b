"""TreeEnsembleClassifier and TreeEnsembleRegressor (ai.onnx.ml 1 and 3): the forest is
flattened into arrays (feature, threshold, mode, children, leaf weights) baked into the module
and walked per row. Trees are checked at build (children exist, no cycles, one root each), so
the walk always ends. Scores accumulate in float in tree order and the binary/base-value
rules are onnxruntime's, so class labels match it exactly."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import dtypes as D
from ..dims import Shape, cdim
from ..dtypes import DType
from .base import Emitter, register
from .ml import _ML, IN_TYPES, post_transform

MODES = {
    "BRANCH_LEQ": 0,
    "BRANCH_LT": 1,
    "BRANCH_GTE": 2,
    "BRANCH_GT": 3,
    "BRANCH_EQ": 4,
    "BRANCH_NEQ": 5,
    "LEAF": 6,
}
COMPARE = {0: "v <= t", 1: "v < t", 2: "v >= t", 3: "v > t", 4: "v == t", 5: "v != t"}


class _Trees(_ML):
    WEIGHTS = "class"

    def thresholds(self) -> np.ndarray[Any, Any]:
        if self.node.attrs.get("nodes_values") is not None:
            return np.asarray(self.attr("nodes_values"), np.float32)
        thr = np.asarray(self.attr("nodes_values_as_tensor"))
        if thr.dtype not in (np.float32, np.float64):
            self.fail("nodes_values_as_tensor must be float or double")
        return thr

    def links(
        self, tree: list[int], node: list[int], modes: list[int], feat: list[int], features: int
    ) -> tuple[dict[tuple[int, int], int], list[int], list[int], set[int]]:
        """(tree, node) -> index, each node's true and false child index, the children."""
        pos = {(t, i): k for k, (t, i) in enumerate(zip(tree, node, strict=True))}
        if len(pos) != len(tree):
            self.fail("a (tree, node) id appears twice")
        n = len(tree)
        true_ix, false_ix = [-1] * n, [-1] * n
        child: set[int] = set()
        ids = {"true": [int(v) for v in self.attr("nodes_truenodeids")],
               "false": [int(v) for v in self.attr("nodes_falsenodeids")]}  # fmt: skip
        if len(ids["true"]) != n or len(ids["false"]) != n:
            self.fail("the nodes_* attributes differ in length")
        for k in (k for k in range(n) if modes[k] != 6):
            if not 0 <= feat[k] < features:
                self.fail(f"node {node[k]} of tree {tree[k]} reads feature {feat[k]} of {features}")
            for side, out in (("true", true_ix), ("false", false_ix)):
                target = pos.get((tree[k], ids[side][k]))
                if target is None:
                    self.fail(
                        f"node {node[k]} of tree {tree[k]} points to missing node {ids[side][k]}"
                    )
                out[k] = target
                child.add(target)
        return pos, true_ix, false_ix, child

    def check_walks(
        self, roots: list[int], true_ix: list[int], false_ix: list[int], leaf: Any
    ) -> None:
        """A walk from each root must end: no internal node is reached twice."""
        for r in roots:
            seen: set[int] = set()
            stack = [r]
            while stack:
                k = stack.pop()
                if leaf(k):
                    continue
                if k in seen:
                    self.fail(f"the tree at node {r} is not a tree (node {k} is reached twice)")
                seen.add(k)
                stack += [true_ix[k], false_ix[k]]

    def leaf_weights(
        self, pos: dict[tuple[int, int], int], n: int
    ) -> tuple[list[int], list[int], list[float]]:
        """Per node, where its weights start; every weight's class (target) and value."""
        w = self.WEIGHTS
        wt, wn, wi = (
            [int(v) for v in self.attr(f"{w}_{k}")] for k in ("treeids", "nodeids", "ids")
        )
        if self.node.attrs.get(f"{w}_weights") is not None:
            wv = np.asarray(self.attr(f"{w}_weights"), np.float32)
        else:
            wv = np.asarray(self.attr(f"{w}_weights_as_tensor")).astype(np.float32)
        if not len(wt) == len(wn) == len(wi) == wv.size:
            self.fail(f"the {w}_* attributes differ in length")
        leaves: dict[int, list[tuple[int, float]]] = {}
        for t, i, c, v in zip(wt, wn, wi, wv.tolist(), strict=True):
            leaf = pos.get((t, i))
            if leaf is None:
                self.fail(f"a weight names missing node {i} of tree {t}")
            leaves.setdefault(leaf, []).append((c, v))
        begin, wcls, wval = [0], [], []
        for k in range(n):
            for c, v in leaves.get(k, []):
                wcls.append(c)
                wval.append(v)
            begin.append(len(wcls))
        return begin, wcls, wval

    def forest(self, features: int) -> None:
        tree = [int(v) for v in self.attr("nodes_treeids")]
        node = [int(v) for v in self.attr("nodes_nodeids")]
        feat = [int(v) for v in self.attr("nodes_featureids")]
        modes_s = list(self.attr("nodes_modes"))
        thr = self.thresholds()
        n = len(tree)
        miss = [int(v) for v in self.attr("nodes_missing_value_tracks_true", [0] * n)]
        if not all(len(x) == n for x in (node, feat, modes_s, miss)) or thr.size != n:
            self.fail("the nodes_* attributes differ in length")
        if any(m not in MODES for m in modes_s):
            self.fail(f"unknown node modes {sorted(set(modes_s) - set(MODES))}")
        modes = [MODES[m] for m in modes_s]
        pos, true_ix, false_ix, child = self.links(tree, node, modes, feat, features)
        trees = sorted(set(tree))
        by_tree = {t: [k for k in range(n) if k not in child and tree[k] == t] for t in trees}
        if any(len(v) != 1 for v in by_tree.values()):
            self.fail("each tree must have exactly one root")
        roots = [by_tree[t][0] for t in trees]
        self.check_walks(roots, true_ix, false_ix, lambda k: modes[k] == 6)
        begin, wcls, wval = self.leaf_weights(pos, n)
        self.arrays: dict[str, tuple[np.ndarray[Any, Any], DType]] = {
            "feat": (np.asarray(feat, np.int32), D.INT32),
            "thr": (thr, D.FLOAT if thr.dtype == np.float32 else D.DOUBLE),
            "mode": (np.asarray(modes, np.uint8), D.UINT8),
            "tru": (np.asarray(true_ix, np.int32), D.INT32),
            "fal": (np.asarray(false_ix, np.int32), D.INT32),
            "miss": (np.asarray(miss, np.uint8), D.UINT8),
            "wbeg": (np.asarray(begin, np.int32), D.INT32),
            "wcls": (np.asarray(wcls or [0], np.int32), D.INT32),
            "wval": (np.asarray(wval or [0.0], np.float32), D.FLOAT),
            "root": (np.asarray(roots, np.int32), D.INT32),
        }
        self.modes_used = sorted({m for m in modes if m != 6})
        self.any_missing = any(miss)
        self.n_trees = len(roots)
        self.wcls_all = wcls
        self.wval_all = wval
        self.thr_c = "float" if thr.dtype == np.float32 else "double"
        self.acc_c = "float"  # scores accumulate in float, as onnxruntime's (double: TreeEnsemble)

    def walk(self, e: Emitter, x: str, leaf: str) -> str:
        """C: for each tree, walk from the root to a leaf and run `leaf` (with `n` the leaf)."""
        arr = {k: e.const(v, d) for k, (v, d) in self.arrays.items()}
        if self.modes_used == [0]:
            cmp = "v <= t"
        else:
            cases = " ".join(f"case {m}: go = {COMPARE[m]}; break;" for m in self.modes_used)
            cmp = None
        lines = [
            f"for (u32 tr = 0; tr < {self.n_trees}; tr++) {{",
            f"  i32 n = {arr['root']}[tr];",
            f"  while ({arr['mode']}[n] != 6) {{",
            f"    const {self.thr_c} v = ({self.thr_c}){x}[{arr['feat']}[n]], t = {arr['thr']}[n];",
        ]
        if cmp is not None:
            lines.append(f"    int go = {cmp};")
        else:
            lines.append(f"    int go = 0; switch ({arr['mode']}[n]) {{ {cases} default: break; }}")
        if self.any_missing:
            lines.append(f"    if (v != v && {arr['miss']}[n]) go = 1;")
        lines.append(f"    n = go ? {arr['tru']}[n] : {arr['fal']}[n];")
        lines.append("  }")
        lines.append(
            f"  for (i32 w = {arr['wbeg']}[n]; w < {arr['wbeg']}[n + 1]; w++) {{ const i32 c = {arr['wcls']}[w]; const {self.acc_c} wv = {arr['wval']}[w]; {leaf} }}"
        )
        lines.append("}")
        return "\n".join(lines)


@register
class TreeEnsembleClassifier(_Trees):
    OP = "TreeEnsembleClassifier"
    WEIGHTS = "class"

    def infer(self) -> list[tuple[DType, Shape]]:
        self.need(0, IN_TYPES)
        self.n, self.f = self.rows()
        self.forest(self.f)
        self.labels_ = self.labels()
        self.c = len(self.labels_)
        if self.c < 2:
            self.fail("needs at least two class labels")
        if any(not 0 <= c < self.c for c in self.wcls_all):
            self.fail("a class weight names a class beyond the labels")
        self.how = self.transform()
        base = self.node.attrs.get("base_values")
        if base is None and self.node.attrs.get("base_values_as_tensor") is not None:
            base = np.asarray(self.attr("base_values_as_tensor")).reshape(-1).tolist()
        self.base = [float(v) for v in (base or [])]
        self.binary_case = self.c == 2 and len(set(self.wcls_all)) == 1
        self.all_positive = all(v >= 0 for v in self.wval_all)
        return [(D.INT64, (self.n,)), (D.FLOAT, (self.n, self.c))]

    def emit(self, e: Emitter) -> str:
        c, f = self.c, self.f
        labels = e.const(np.asarray(self.labels_, np.int64), D.INT64)
        t = self.x(0).dtype.c
        head = [
            f"for (u32 r = 0; r < {cdim(self.n)}; r++) {{",
            f"  const {t} *x = {e.inp(0)} + r * {f};",
            f"  float sc[{c}]; u8 has[{c}];",
            f"  for (u32 k = 0; k < {c}; k++) {{ sc[k] = 0; has[k] = 0; }}",
            self.walk(e, "x", "sc[c] += wv; has[c] = 1;"),
        ]
        y, z = e.out(0), e.out(1)
        base = self.base
        body: list[str] = []
        if c > 2:
            for k, b in enumerate(base[:c]):
                body.append(
                    f"  if (!has[{k}]) {{ has[{k}] = 1; sc[{k}] = {float(np.float32(b)).hex()}f; }} else sc[{k}] += {float(np.float32(b)).hex()}f;"
                )
            body.append(
                f"  i32 best = -1; for (u32 k = 0; k < {c}; k++) if (has[k] && (best < 0 || sc[k] > sc[best])) best = (i32)k;"
            )
            body.append(f"  if (best < 0) {e.error('no tree produced a score')}")
            body.append(f"  {y}[r] = {labels}[best];")
            body.append(
                f"  float zz[{c}]; for (u32 k = 0; k < {c}; k++) zz[k] = has[k] ? sc[k] : 0;"
            )
            body.append("  " + post_transform("zz", c, self.how))
            body.append(f"  for (u32 k = 0; k < {c}; k++) {z}[r * {c} + k] = zz[k];")
        else:
            bv = [float(np.float32(v)) for v in base]
            body.append("  u32 size = 2; i32 wa = -1;")
            if len(bv) == 2:
                body.append(
                    f"  if (has[1]) {{ sc[1] = {bv[1].hex()}f + sc[0]; sc[0] = -sc[1]; }} else {{ sc[1] += {bv[1].hex()}f; sc[0] += {bv[0].hex()}f; }}"
                )
            elif len(bv) == 1:
                body.append(f"  sc[0] += {bv[0].hex()}f; if (!has[1]) size = 1;")
            elif not bv:
                body.append("  wa = 3; if (!has[1]) size = 1;")
            else:
                self.fail(f"{len(bv)} base values for 2 classes")
            body.append("  const float pos = (size == 2 && has[1]) ? sc[1] : (has[0] ? sc[0] : 0);")
            if self.binary_case and self.all_positive:
                body.append(
                    f"  if (pos > 0.5f) {{ wa = 0; {y}[r] = {self.labels_[1]}; }} else {{ wa = 1; {y}[r] = {self.labels_[0]}; }}"
                )
            elif self.binary_case:
                body.append(
                    f"  if (pos > 0) {{ wa = 2; {y}[r] = {self.labels_[1]}; }} else {{ wa = 3; {y}[r] = {self.labels_[0]}; }}"
                )
            else:
                body.append(f"  {y}[r] = pos > 0 ? 1 : 0;")
            logistic = self.how == "LOGISTIC"
            body.append("  float zz[2];")
            body.append(
                "  if (size == 2) { zz[0] = has[0] ? sc[0] : 0; zz[1] = has[1] ? sc[1] : 0; "
                + post_transform("zz", 2, self.how)
                + " }"
            )
            body.append("  else {")
            body.append("    const float s = has[0] ? sc[0] : 0;")
            body.append("    if (wa == 0 || wa == 1) { zz[0] = 1.0f - s; zz[1] = s; }")
            if logistic:
                body.append(
                    "    else if (wa == 2 || wa == 3) { zz[0] = (float)mf_sigmoid(-(double)s); zz[1] = (float)mf_sigmoid((double)s); }"
                )
            else:
                body.append("    else if (wa == 2 || wa == 3) { zz[0] = -s; zz[1] = s; }")
            body.append("    else { zz[0] = s; zz[1] = 0; }")
            body.append("  }")
            body.append(f"  {z}[r * 2] = zz[0]; {z}[r * 2 + 1] = zz[1];")
        return "\n".join(head + body + ["}"])


@register
class TreeEnsembleRegressor(_Trees):
    OP = "TreeEnsembleRegressor"
    WEIGHTS = "target"

    def infer(self) -> list[tuple[DType, Shape]]:
        self.need(0, IN_TYPES)
        self.n, self.f = self.rows()
        self.forest(self.f)
        self.t = int(self.attr("n_targets"))
        if any(not 0 <= c < self.t for c in self.wcls_all):
            self.fail("a target weight names a target beyond n_targets")
        self.agg = self.attr("aggregate_function", "SUM")
        if self.agg not in ("SUM", "AVERAGE", "MIN", "MAX"):
            self.fail(f"aggregate_function={self.agg!r} is not supported")
        self.how = self.transform()
        base = self.node.attrs.get("base_values")
        if base is None and self.node.attrs.get("base_values_as_tensor") is not None:
            base = np.asarray(self.attr("base_values_as_tensor")).reshape(-1).tolist()
        self.base = [float(np.float32(v)) for v in (base or [])]
        return [(D.FLOAT, (self.n, self.t))]

    def emit(self, e: Emitter) -> str:
        t, f = self.t, self.f
        x_t = self.x(0).dtype.c
        z = e.out(0)
        if self.agg in ("SUM", "AVERAGE"):
            step = "sc[c] += wv; has[c] = 1;"
        elif self.agg == "MIN":
            step = "if (!has[c] || wv < sc[c]) sc[c] = wv; has[c] = 1;"
        else:
            step = "if (!has[c] || wv > sc[c]) sc[c] = wv; has[c] = 1;"
        if t == 1:  # onnxruntime's single-target path reads only each leaf's first weight
            step = f"if (w == {e.const(self.arrays['wbeg'][0], D.INT32)}[n]) {{ {step} }}"
        lines = [
            f"for (u32 r = 0; r < {cdim(self.n)}; r++) {{",
            f"  const {x_t} *x = {e.inp(0)} + r * {f};",
            f"  {self.acc_c} sc[{t}]; u8 has[{t}];",
            f"  for (u32 k = 0; k < {t}; k++) {{ sc[k] = 0; has[k] = 0; }}",
            self.walk(e, "x", step),
        ]
        sfx = "f" if self.acc_c == "float" else ""
        avg = f" / {self.n_trees}.0{sfx}" if self.agg == "AVERAGE" else ""
        if t == 1:
            origin = self.base[0] if len(self.base) == 1 else 0.0
            if self.agg in ("SUM", "AVERAGE"):
                lines.append(f"  {z}[r] = sc[0]{avg} + {origin.hex()}{sfx};")
            else:
                lines.append(
                    f"  {z}[r] = has[0] ? sc[0] + {origin.hex()}{sfx} : {origin.hex()}{sfx};"
                )
        else:
            use_base = len(self.base) == t
            for k in range(t):
                b = f"{self.base[k].hex()}{sfx}" if use_base else f"0.0{sfx}"
                if self.agg in ("SUM", "AVERAGE"):
                    lines.append(f"  sc[{k}] = sc[{k}]{avg} + {b};")
                else:
                    lines.append(f"  sc[{k}] = {b} + (has[{k}] ? sc[{k}] : 0);")
            lines.append("  " + post_transform("sc", t, self.how))
            lines.append(f"  for (u32 k = 0; k < {t}; k++) {z}[r * {t} + k] = sc[k];")
        lines.append("}")
        return "\n".join(lines)


_ = Any


@register
class TreeEnsemble(TreeEnsembleRegressor):
    """ai.onnx.ml 5's unified tree ensemble (leaves in their own array, splits as a tensor),
    mapped onto the same flattened forest; set-membership splits are refused."""

    OP = "TreeEnsemble"
    SINCE = 5

    def v5_children(self, n: int, leaves: int) -> tuple[list[int], list[int]]:
        """Children as indices into one array of nodes then leaves (leaf i at n + i)."""
        sides = []
        for ids_name, leaf_name in (
            ("nodes_truenodeids", "nodes_trueleafs"),
            ("nodes_falsenodeids", "nodes_falseleafs"),
        ):
            ids = [int(v) for v in self.attr(ids_name)]
            is_leaf = [int(v) for v in self.attr(leaf_name)]
            if len(ids) != n or len(is_leaf) != n:
                self.fail("the nodes_* attributes differ in length")
            out = []
            for ix, leaf in zip(ids, is_leaf, strict=True):
                if not 0 <= ix < (leaves if leaf else n):
                    self.fail(f"a node points to missing {'leaf' if leaf else 'node'} {ix}")
                out.append(n + ix if leaf else ix)
            sides.append(out)
        return sides[0], sides[1]

    def v5_options(self, dtype: DType) -> None:
        self.agg = {0: "AVERAGE", 1: "SUM", 2: "MIN", 3: "MAX"}.get(
            int(self.attr("aggregate_function", 1)), ""
        )
        how = int(self.attr("post_transform", 0))
        self.how = {0: "NONE", 1: "SOFTMAX", 2: "LOGISTIC", 3: "SOFTMAX_ZERO"}.get(how, "")
        if not self.agg or not self.how:
            self.fail("aggregate_function or post_transform is not supported (PROBIT is not)")
        if dtype == D.DOUBLE and self.how != "NONE":
            self.fail("post_transform on float64 scores is not supported (they are float32 here)")
        self.base = []

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, D.FLOATS)
        self.n, self.f = self.rows()
        modes = [int(m) for m in np.asarray(self.attr("nodes_modes")).reshape(-1)]
        if 6 in modes:
            self.fail("set-membership splits (BRANCH_MEMBER) are not supported")
        feat = [int(v) for v in self.attr("nodes_featureids")]
        split = np.asarray(self.attr("nodes_splits")).reshape(-1)
        n = len(feat)
        miss = [int(v) for v in self.attr("nodes_missing_value_tracks_true", [0] * n)]
        roots = [int(v) for v in self.attr("tree_roots")]
        targets = [int(v) for v in self.attr("leaf_targetids")]
        weights = np.asarray(self.attr("leaf_weights")).reshape(-1)
        leaves = len(targets)
        if len(modes) != n or len(miss) != n or split.size != n or weights.size != leaves:
            self.fail("the nodes_* or leaf_* attributes differ in length")
        self.t = int(self.attr("n_targets"))
        if any(not 0 <= c < self.t for c in targets) or any(not 0 <= f < self.f for f in feat):
            self.fail("a leaf names a target beyond n_targets, or a node a feature beyond X's")
        if any(not 0 <= r < n for r in roots):
            self.fail("a tree root is not a node")
        true_ix, false_ix = self.v5_children(n, leaves)
        self.check_walks(roots, true_ix, false_ix, lambda k: k >= n)
        thr_dtype = D.FLOAT if split.dtype == np.float32 else D.DOUBLE
        self.arrays = {
            "feat": (np.asarray(feat + [0] * leaves, np.int32), D.INT32),
            "thr": (np.concatenate([split, np.zeros(leaves, split.dtype)]), thr_dtype),
            "mode": (np.asarray(modes + [6] * leaves, np.uint8), D.UINT8),
            "tru": (np.asarray(true_ix + [-1] * leaves, np.int32), D.INT32),
            "fal": (np.asarray(false_ix + [-1] * leaves, np.int32), D.INT32),
            "miss": (np.asarray(miss + [0] * leaves, np.uint8), D.UINT8),
            "wbeg": (np.asarray([0] * (n + 1) + list(range(1, leaves + 1)), np.int32), D.INT32),
            "wcls": (np.asarray(targets or [0], np.int32), D.INT32),
            "wval": (weights.astype(dtype.np) if leaves else np.zeros(1, dtype.np), dtype),
            "root": (np.asarray(roots, np.int32), D.INT32),
        }
        self.modes_used = sorted(set(modes))
        self.any_missing = any(miss)
        self.n_trees = len(roots)
        self.wcls_all, self.wval_all = targets, weights.tolist()
        self.thr_c, self.acc_c = thr_dtype.c, dtype.c
        self.v5_options(dtype)
        return [(dtype, (self.n, self.t))]
