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

    def forest(self, features: int) -> None:
        a = self.attr
        tree = [int(v) for v in a("nodes_treeids")]
        node = [int(v) for v in a("nodes_nodeids")]
        n = len(tree)
        feat = [int(v) for v in a("nodes_featureids")]
        modes_s = list(a("nodes_modes"))
        tru = [int(v) for v in a("nodes_truenodeids")]
        fal = [int(v) for v in a("nodes_falsenodeids")]
        if self.node.attrs.get("nodes_values") is not None:
            thr = np.asarray(a("nodes_values"), np.float32)
        else:
            thr = np.asarray(a("nodes_values_as_tensor"))
            if thr.dtype not in (np.float32, np.float64):
                self.fail("nodes_values_as_tensor must be float or double")
        miss = [int(v) for v in a("nodes_missing_value_tracks_true", [0] * n)]
        if not all(len(x) == n for x in (node, feat, modes_s, tru, fal, miss)) or thr.size != n:
            self.fail("the nodes_* attributes differ in length")
        if any(m not in MODES for m in modes_s):
            self.fail(f"unknown node modes {sorted(set(modes_s) - set(MODES))}")
        modes = [MODES[m] for m in modes_s]
        pos = {(t, i): k for k, (t, i) in enumerate(zip(tree, node, strict=True))}
        if len(pos) != n:
            self.fail("a (tree, node) id appears twice")
        true_ix, false_ix = [0] * n, [0] * n
        child: set[int] = set()
        for k in range(n):
            if modes[k] == 6:
                true_ix[k] = false_ix[k] = -1
                continue
            if not 0 <= feat[k] < features:
                self.fail(f"node {node[k]} of tree {tree[k]} reads feature {feat[k]} of {features}")
            for ids, out in ((tru, true_ix), (fal, false_ix)):
                target = pos.get((tree[k], ids[k]))
                if target is None:
                    self.fail(f"node {node[k]} of tree {tree[k]} points to missing node {ids[k]}")
                out[k] = target
                child.add(target)
        roots = [k for k in range(n) if k not in child]
        trees = sorted(set(tree))
        by_tree = {t: [k for k in roots if tree[k] == t] for t in trees}
        if any(len(v) != 1 for v in by_tree.values()):
            self.fail("each tree must have exactly one root")
        root_list = [by_tree[t][0] for t in trees]
        for r in root_list:  # a walk from the root must end: no node reached twice
            seen: set[int] = set()
            stack = [r]
            while stack:
                k = stack.pop()
                if k in seen:
                    self.fail(f"tree {tree[r]} is not a tree (node {node[k]} is reached twice)")
                seen.add(k)
                if modes[k] != 6:
                    stack += [true_ix[k], false_ix[k]]
        w = self.WEIGHTS
        wt = [int(v) for v in a(f"{w}_treeids")]
        wn = [int(v) for v in a(f"{w}_nodeids")]
        wi = [int(v) for v in a(f"{w}_ids")]
        if self.node.attrs.get(f"{w}_weights") is not None:
            wv = np.asarray(a(f"{w}_weights"), np.float32)
        else:
            wv = np.asarray(a(f"{w}_weights_as_tensor")).astype(np.float32)
        if not len(wt) == len(wn) == len(wi) == wv.size:
            self.fail(f"the {w}_* attributes differ in length")
        leaves: dict[int, list[tuple[int, float]]] = {}
        for t, i, c, v in zip(wt, wn, wi, wv.tolist(), strict=True):
            leaf = pos.get((t, i))
            if leaf is None:
                self.fail(f"a weight names missing node {i} of tree {t}")
            leaves.setdefault(leaf, []).append((c, v))
        begin = [0]
        wcls: list[int] = []
        wval: list[float] = []
        for k in range(n):
            for c, v in leaves.get(k, []):
                wcls.append(c)
                wval.append(v)
            begin.append(len(wcls))
        self.n_nodes = n
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
            "root": (np.asarray(root_list, np.int32), D.INT32),
        }
        self.modes_used = sorted({m for m in modes if m != 6})
        self.any_missing = any(miss)
        self.n_trees = len(root_list)
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

    def infer(self) -> list[tuple[DType, Shape]]:
        dtype = self.need(0, D.FLOATS)
        self.n, self.f = self.rows()
        a = self.attr
        modes = [int(m) for m in np.asarray(a("nodes_modes")).reshape(-1)]
        if any(m == 6 for m in modes):
            self.fail("set-membership splits (BRANCH_MEMBER) are not supported")
        feat = [int(v) for v in a("nodes_featureids")]
        split = np.asarray(a("nodes_splits")).reshape(-1)
        tru, fal = (
            [int(v) for v in a("nodes_truenodeids")],
            [int(v) for v in a("nodes_falsenodeids")],
        )
        tleaf, fleaf = (
            [int(v) for v in a("nodes_trueleafs")],
            [int(v) for v in a("nodes_falseleafs")],
        )
        miss = [int(v) for v in a("nodes_missing_value_tracks_true", [0] * len(feat))]
        roots = [int(v) for v in a("tree_roots")]
        targets = [int(v) for v in a("leaf_targetids")]
        weights = np.asarray(a("leaf_weights")).reshape(-1)
        n, leaves = len(feat), len(targets)
        if not all(len(x) == n for x in (modes, tru, fal, tleaf, fleaf, miss)) or split.size != n:
            self.fail("the nodes_* attributes differ in length")
        if weights.size != leaves:
            self.fail("leaf_targetids and leaf_weights differ in length")
        self.t = int(a("n_targets"))
        if any(not 0 <= c < self.t for c in targets):
            self.fail("a leaf names a target beyond n_targets")

        def child(ix: int, leaf: int) -> int:
            limit = leaves if leaf else n
            if not 0 <= ix < limit:
                self.fail(f"a node points to missing {'leaf' if leaf else 'node'} {ix}")
            return n + ix if leaf else ix

        true_ix = [child(tru[k], tleaf[k]) for k in range(n)]
        false_ix = [child(fal[k], fleaf[k]) for k in range(n)]
        if any(not 0 <= feat[k] < self.f for k in range(n)):
            self.fail("a node reads a feature beyond the input's")
        for r in roots:  # every walk ends: an internal node is never reached twice
            if not 0 <= r < n:
                self.fail(f"tree root {r} is not a node")
            seen: set[int] = set()
            stack = [r]
            while stack:
                k = stack.pop()
                if k >= n:
                    continue
                if k in seen:
                    self.fail(f"the tree at root {r} is not a tree (node {k} is reached twice)")
                seen.add(k)
                stack += [true_ix[k], false_ix[k]]
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
        self.thr_c = thr_dtype.c
        self.acc_c = dtype.c
        agg = int(a("aggregate_function", 1))
        self.agg = {0: "AVERAGE", 1: "SUM", 2: "MIN", 3: "MAX"}.get(agg, "")
        how = int(a("post_transform", 0))
        self.how = {0: "NONE", 1: "SOFTMAX", 2: "LOGISTIC", 3: "SOFTMAX_ZERO"}.get(how, "")
        if not self.agg or not self.how:
            self.fail("aggregate_function or post_transform is not supported (PROBIT is not)")
        if dtype == D.DOUBLE and self.how != "NONE":
            self.fail("post_transform on float64 scores is not supported (they are float32 here)")
        self.base = []
        return [(dtype, (self.n, self.t))]
