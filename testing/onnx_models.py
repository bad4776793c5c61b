"""Example ONNX models for the model compiler's tests and benchmarks: scikit-learn models
exported with skl2onnx (trained on scikit-learn's bundled data sets, so nothing is
downloaded), and graphs written with onnx.helper (an MLP, a small CNN trained here with numpy
on the 8x8 digits, a transformer decoder block). Each comes with held-out rows and the
tolerance its operator family is held to against onnxruntime."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# Tolerances against onnxruntime, per operator family (max |got - want| <= atol + rtol*|want|).
# float32 arithmetic differs by summation order only; transcendental functions are computed in
# double here and in float32 there; tree ensembles must give identical labels.
TOLERANCE = {
    "linear": (1e-5, 1e-6),  # Gemm/MatMul/linear models/scalers/normalisers (rtol, atol)
    "mlp": (1e-5, 1e-6),
    "cnn": (1e-5, 1e-5),
    "trees": (1e-5, 1e-6),
    "svm": (1e-4, 1e-5),  # kernels: exp/tanh/pow in double vs float32
    "transformer": (1e-4, 1e-5),  # LayerNorm, Softmax, Gelu (erf)
    "recurrent": (1e-4, 1e-5),  # float32 sigmoid/tanh kernels against onnxruntime's, over the steps
}


@dataclass
class Example:
    name: str
    family: str
    model: onnx.ModelProto
    x: np.ndarray[Any, Any]  # held-out rows
    label_outputs: tuple[int, ...] = ()  # outputs that must match exactly (class labels)

    @property
    def tolerance(self) -> tuple[float, float]:
        return TOLERANCE[self.family]


def _split4(x: Any, y: Any, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """75% training rows, 25% held out (features as float32): x_train, y_train, x_test, y_test."""
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(x))
    cut = int(len(x) * 0.75)
    train, test = idx[:cut], idx[cut:]
    return x[train].astype(np.float32), y[train], x[test].astype(np.float32), y[test]


def _split(x: Any, y: Any, seed: int = 0) -> tuple[Any, Any, Any]:
    xtr, ytr, xte, _ = _split4(x, y, seed)
    return xtr, ytr, xte


def _sk(
    name: str,
    family: str,
    make: Callable[[], Any],
    data: str,
    labels: bool = True,
    nan_rows: bool = False,
) -> Example:
    from skl2onnx import to_onnx
    from sklearn import datasets

    loader = {
        "iris": datasets.load_iris,
        "digits": datasets.load_digits,
        "cancer": datasets.load_breast_cancer,
        "diabetes": datasets.load_diabetes,
    }[data]
    x, y = loader(return_X_y=True)
    xtr, ytr, xte = _split(x, y)
    if nan_rows:  # some missing values for the imputer, in training and held-out rows
        rng = np.random.default_rng(1)
        xtr[rng.random(xtr.shape) < 0.05] = np.nan
        xte[rng.random(xte.shape) < 0.05] = np.nan
    model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(xtr, ytr)
        options = {id(model): {"zipmap": False}} if labels else None
        onx = to_onnx(model, xtr[:1], options=options, target_opset={"": 17, "ai.onnx.ml": 3})
    onx.graph.name = name
    return Example(name, family, onx, xte, (0,) if labels else ())


def sklearn_examples() -> list[Example]:
    from sklearn.ensemble import (
        GradientBoostingClassifier,
        HistGradientBoostingClassifier,
        RandomForestClassifier,
        RandomForestRegressor,
    )
    from sklearn.impute import SimpleImputer
    from sklearn.linear_model import LinearRegression, LogisticRegression
    from sklearn.neighbors import KNeighborsClassifier, KNeighborsRegressor
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import Normalizer, StandardScaler
    from sklearn.svm import SVC, SVR
    from sklearn.tree import DecisionTreeClassifier

    return [
        _sk("logreg-iris", "linear", lambda: LogisticRegression(max_iter=1000), "iris"),
        _sk(
            "logreg-cancer",
            "linear",
            lambda: make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)),
            "cancer",
        ),
        _sk("linreg-diabetes", "linear", LinearRegression, "diabetes", labels=False),
        _sk(
            "mlp-digits",
            "mlp",
            lambda: MLPClassifier((32,), max_iter=300, random_state=0),
            "digits",
        ),
        _sk("tree-iris", "trees", lambda: DecisionTreeClassifier(random_state=0), "iris"),
        _sk("forest-cancer", "trees", lambda: RandomForestClassifier(50, random_state=0), "cancer"),
        _sk("forest-digits", "trees", lambda: RandomForestClassifier(30, random_state=0), "digits"),
        _sk(
            "forest-diabetes",
            "trees",
            lambda: RandomForestRegressor(30, random_state=0),
            "diabetes",
            labels=False,
        ),
        _sk(
            "gboost-cancer",
            "trees",
            lambda: GradientBoostingClassifier(n_estimators=50, random_state=0),
            "cancer",
        ),
        _sk(
            "gboost-iris",
            "trees",
            lambda: GradientBoostingClassifier(n_estimators=30, random_state=0),
            "iris",
        ),
        _sk(
            "hgboost-iris",
            "trees",
            lambda: HistGradientBoostingClassifier(max_iter=30, random_state=0),
            "iris",
        ),
        _sk("svc-iris", "svm", SVC, "iris"),
        _sk("svc-cancer", "svm", lambda: make_pipeline(StandardScaler(), SVC()), "cancer"),
        _sk("svr-diabetes", "svm", SVR, "diabetes", labels=False),
        _sk("svc-proba-iris", "svm", lambda: SVC(probability=True, random_state=0), "iris"),
        _sk("knn-iris", "linear", lambda: KNeighborsClassifier(5), "iris"),
        _sk("knn-diabetes", "linear", lambda: KNeighborsRegressor(5), "diabetes", labels=False),
        _sk(
            "svc-proba-cancer",
            "svm",
            lambda: make_pipeline(StandardScaler(), SVC(probability=True, random_state=0)),
            "cancer",
        ),
        _sk(
            "pipeline-iris",
            "linear",
            lambda: make_pipeline(
                SimpleImputer(), StandardScaler(), Normalizer(), LogisticRegression(max_iter=1000)
            ),
            "iris",
            nan_rows=True,
        ),
    ]


# --------------------------------------------------------------------------- hand-built graphs
def _init(name: str, value: np.ndarray[Any, Any]) -> TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(value), name)


def mlp_example() -> Example:
    """A PyTorch-style MLP (Gemm with transB=1 weights, Relu, Gelu, Softmax) on random data."""
    rng = np.random.default_rng(2)
    w1, b1 = (
        rng.normal(0, 0.3, (64, 16)).astype(np.float32),
        rng.normal(0, 0.1, 64).astype(np.float32),
    )
    w2, b2 = (
        rng.normal(0, 0.3, (32, 64)).astype(np.float32),
        rng.normal(0, 0.1, 32).astype(np.float32),
    )
    w3, b3 = (
        rng.normal(0, 0.3, (4, 32)).astype(np.float32),
        rng.normal(0, 0.1, 4).astype(np.float32),
    )
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], transB=1),
        helper.make_node("Relu", ["h1"], ["a1"]),
        helper.make_node("Gemm", ["a1", "w2", "b2"], ["h2"], transB=1),
        helper.make_node("Gelu", ["h2"], ["a2"]),
        helper.make_node("Gemm", ["a2", "w3", "b3"], ["logits"], transB=1),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 4])],
        [
            _init(n, v)
            for n, v in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2), ("w3", w3), ("b3", b3))
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    return Example("mlp-onnx", "mlp", model, rng.normal(0, 1, (64, 16)).astype(np.float32))


@functools.cache
def _trained_cnn() -> dict[str, np.ndarray[Any, Any]]:
    """A tiny CNN (conv 3x3x8 + ReLU + maxpool 2 + dense 10) trained on the 8x8 digits with
    numpy and a hand-written backward pass (a few epochs of SGD: ~97% held-out accuracy)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    xtr, ytr, _ = _split(x / 16.0, y)
    xtr = xtr.reshape(-1, 1, 8, 8)
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.3, (8, 1, 3, 3))
    b = np.zeros(8)
    v = rng.normal(0, 0.05, (10, 128))
    c = np.zeros(10)

    def im2col(imgs: Any) -> Any:  # [n,1,8,8] -> [n, 64, 9] (pad 1)
        p = np.pad(imgs[:, 0], ((0, 0), (1, 1), (1, 1)))
        cols = np.stack([p[:, i : i + 8, j : j + 8] for i in range(3) for j in range(3)], axis=-1)
        return cols.reshape(len(imgs), 64, 9)

    lr = 0.1
    for _epoch in range(12):
        for start in range(0, len(xtr), 32):
            xb, yb = xtr[start : start + 32], ytr[start : start + 32]
            cols = im2col(xb)
            z = cols @ w.reshape(8, 9).T + b  # [n,64,8]
            a = np.maximum(z, 0)
            a4 = a.reshape(-1, 4, 2, 4, 2, 8)
            pooled = a4.max(axis=(2, 4))  # [n,4,4,8]
            flat = pooled.transpose(0, 3, 1, 2).reshape(len(xb), 128)  # NCHW flatten
            logits = flat @ v.T + c
            p = np.exp(logits - logits.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            g = p.copy()
            g[np.arange(len(xb)), yb] -= 1
            g /= len(xb)
            gv, gc = g.T @ flat, g.sum(0)
            gflat = (g @ v).reshape(-1, 8, 4, 4).transpose(0, 2, 3, 1)  # [n,4,4,8]
            mask = a4 == pooled[:, :, None, :, None, :]
            ga = (mask * gflat[:, :, None, :, None, :]).reshape(-1, 64, 8) * (z > 0)
            gw = np.einsum("npk,npc->kc", ga, cols).reshape(8, 1, 3, 3)
            w -= lr * gw
            b -= lr * ga.sum((0, 1))
            v -= lr * gv
            c -= lr * gc
    return {
        "w": w.astype(np.float32),
        "b": b.astype(np.float32),
        "v": v.astype(np.float32),
        "c": c.astype(np.float32),
    }


def cnn_example(
    directory: Path | None = None, input_name: str = "x", file_name: str = "model.onnx"
) -> Example:
    """The trained CNN as an ONNX graph. With `directory`, saved there as model.onnx with its
    weights in model.onnx.data (PyTorch's exporter's layout), to prove external data is read."""
    from sklearn.datasets import load_digits

    p = _trained_cnn()
    nodes = [
        helper.make_node(
            "Conv", [input_name, "w", "b"], ["c1"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]
        ),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p1"], ["f1"], axis=1),
        helper.make_node("Gemm", ["f1", "v", "c"], ["logits"], transB=1),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
        helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn-digits",
        [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [
            helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"]),
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 10]),
        ],
        [_init(n, p[n]) for n in ("w", "b", "v", "c")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x, y = load_digits(return_X_y=True)
    _, _, xte = _split(x / 16.0, y)
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        onnx.save_model(
            model,
            str(directory / file_name),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=f"{file_name}.data",
            size_threshold=0,
        )
        model = onnx.load_model(str(directory / file_name), load_external_data=False)
    return Example("cnn-digits", "cnn", model, xte.reshape(-1, 1, 8, 8).astype(np.float32), (0,))


def decoder_block_example() -> Example:
    """One pre-norm transformer decoder block over token ids: Gather (embeddings),
    LayerNormalization, MatMul with broadcasting, causal mask (Where), Softmax over the last
    axis, Gelu, residual Adds, Reshape/Transpose for 2 heads. Random weights, batch symbolic."""
    rng = np.random.default_rng(3)
    vocab, seq, d, heads = 50, 8, 16, 2
    hd = d // heads

    def w(*shape: int) -> np.ndarray[Any, Any]:
        return rng.normal(0, 0.2, shape).astype(np.float32)

    inits = {
        "emb": w(vocab, d),
        "pos": w(seq, d),
        "g1": 1 + w(d),
        "b1": w(d),
        "wq": w(d, d),
        "wk": w(d, d),
        "wv": w(d, d),
        "wo": w(d, d),
        "g2": 1 + w(d),
        "b2": w(d),
        "w1": w(d, 4 * d),
        "w2": w(4 * d, d),
        "heads_shape": np.array([0, seq, heads, hd], np.int64),
        "merge_shape": np.array([0, seq, d], np.int64),
        "scale": np.array(1 / np.sqrt(hd), np.float32),
        "causal": np.tril(np.ones((seq, seq), bool)),
        "neg": np.array(-1e9, np.float32),
    }
    n = helper.make_node
    nodes = [
        n("Gather", ["emb", "ids"], ["tok"]),
        n("Add", ["tok", "pos"], ["h0"]),
        n("LayerNormalization", ["h0", "g1", "b1"], ["ln1"], axis=-1, epsilon=1e-5),
        *[n("MatMul", ["ln1", f"w{k}"], [k]) for k in "qkv"],
        *[n("Reshape", [k, "heads_shape"], [f"{k}h"]) for k in "qkv"],
        n("Transpose", ["qh"], ["qt"], perm=[0, 2, 1, 3]),
        n("Transpose", ["kh"], ["kt"], perm=[0, 2, 3, 1]),
        n("Transpose", ["vh"], ["vt"], perm=[0, 2, 1, 3]),
        n("MatMul", ["qt", "kt"], ["att0"]),
        n("Mul", ["att0", "scale"], ["att1"]),
        n("Where", ["causal", "att1", "neg"], ["att2"]),
        n("Softmax", ["att2"], ["att"], axis=-1),
        n("MatMul", ["att", "vt"], ["ctx0"]),
        n("Transpose", ["ctx0"], ["ctx1"], perm=[0, 2, 1, 3]),
        n("Reshape", ["ctx1", "merge_shape"], ["ctx"]),
        n("MatMul", ["ctx", "wo"], ["attn_out"]),
        n("Add", ["h0", "attn_out"], ["h1"]),
        n("LayerNormalization", ["h1", "g2", "b2"], ["ln2"], axis=-1, epsilon=1e-5),
        n("MatMul", ["ln2", "w1"], ["ff0"]),
        n("Gelu", ["ff0"], ["ff1"]),
        n("MatMul", ["ff1", "w2"], ["ff2"]),
        n("Add", ["h1", "ff2"], ["hidden"]),
    ]
    graph = helper.make_graph(
        nodes,
        "decoder-block",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", seq])],
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", seq, d])],
        [_init(k, v) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    x = rng.integers(0, vocab, (16, seq)).astype(np.int64)
    return Example("decoder-block", "transformer", model, x)


@functools.cache
def recurrent_example() -> Example:
    """A sequence classifier as PyTorch exports `nn.LSTM(batch_first=True,
    bidirectional=True)` followed by `nn.GRU`: the batch-first input moved time-major
    (Transpose), the LSTM's Y merged over its directions (Transpose, Reshape with the batch as
    -1) into the GRU, its last state through a linear layer to softmax; on the way a LRN over
    the LSTM's output channels (the classic CNNs' layer, on an [N, C, T, 1] view). Random
    weights, batch symbolic."""
    rng = np.random.default_rng(4)
    seq, feat, h1, h2, classes = 10, 6, 8, 12, 3

    def w(*shape: int, scale: float = 0.4) -> np.ndarray[Any, Any]:
        return rng.normal(0, scale, shape).astype(np.float32)

    inits = {
        "lw": w(2, 4 * h1, feat), "lr": w(2, 4 * h1, h1), "lb": w(2, 8 * h1, scale=0.2),
        "gw": w(1, 3 * h2, 2 * h1), "gr": w(1, 3 * h2, h2), "gb": w(1, 6 * h2, scale=0.2),
        "merge": np.array([seq, -1, 2 * h1], np.int64),
        "zero": np.array([0], np.int64),
        "three": np.array([3], np.int64),
        "fw": w(classes, h2), "fb": w(classes, scale=0.1),
    }  # fmt: skip
    n = helper.make_node
    nodes = [
        n("Transpose", ["x"], ["xt"], perm=[1, 0, 2]),  # [T, N, F]
        n("LSTM", ["xt", "lw", "lr", "lb"], ["ly", "lh", "lc"], hidden_size=h1,
          direction="bidirectional"),  # [T, 2, N, H1]
        n("Transpose", ["ly"], ["lyt"], perm=[0, 2, 1, 3]),  # [T, N, 2, H1]
        n("Reshape", ["lyt", "merge"], ["seq2"]),  # [T, N, 2*H1]
        n("Transpose", ["seq2"], ["chan"], perm=[1, 2, 0]),  # [N, 2*H1, T]
        n("Unsqueeze", ["chan", "three"], ["image"]),  # [N, 2*H1, T, 1]
        n("LRN", ["image"], ["norm4"], size=3, alpha=0.05, beta=0.75, bias=1.0),
        n("Squeeze", ["norm4", "three"], ["norm"]),
        n("Transpose", ["norm"], ["seq3"], perm=[2, 0, 1]),  # [T, N, 2*H1]
        n("GRU", ["seq3", "gw", "gr", "gb"], ["", "gh"], hidden_size=h2,
          linear_before_reset=1),  # [1, N, H2]
        n("Squeeze", ["gh", "zero"], ["last"]),
        n("Gemm", ["last", "fw", "fb"], ["logits"], transB=1),
        n("Softmax", ["logits"], ["probabilities"], axis=-1),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "recurrent",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", seq, feat])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", classes])],
        [_init(k, v) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    return Example("recurrent-lstm-gru", "recurrent", model, w(32, seq, feat, scale=1.0))


def all_examples() -> list[Example]:
    return [
        *sklearn_examples(), mlp_example(), cnn_example(), decoder_block_example(),
        recurrent_example(),
    ]  # fmt: skip


# --------------------------------------------------------------------------- example functions
# The models of the example functions (functions/examples/*: each train.py calls
# `prepare_function`), made at build time the way a user makes theirs: trained on a data set
# scikit-learn bundles and exported with skl2onnx, or, for the CNN, a graph as PyTorch's
# exporter writes it (weights in external data). The held-out rows go into the build report;
# `meshfn fn build` scores the compiled module on them (the accuracy of what is served).


def _digits(side: int) -> tuple[Any, Any]:
    """scikit-learn's 8x8 digits (pixels 0-16), upsampled (bilinear) to side x side."""
    from scipy.ndimage import zoom
    from sklearn.datasets import load_digits

    data = load_digits()
    images = data.images
    if side != 8:
        images = zoom(images, (1, side / 8, side / 8), order=1).clip(0, 16).round(4)
    return images.reshape(len(images), side * side), data.target


def _function_recipes() -> dict[str, tuple[Callable[[], Any], Callable[[], Any], str]]:
    """name -> (its data, its estimator, what it is)."""
    from sklearn import datasets
    from sklearn.ensemble import GradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    def scaled_logreg() -> Any:
        return make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000))

    return {
        "iris": (
            lambda: datasets.load_iris(return_X_y=True),
            lambda: make_pipeline(
                StandardScaler(), MLPClassifier((16,), max_iter=3000, random_state=0)
            ),
            "standard scaler + MLP 4-16-3 (relu, softmax)",
        ),
        "digits": (lambda: _digits(8), scaled_logreg, "scaler + logistic regression 64 -> 10"),
        "digits28": (
            lambda: _digits(28),
            scaled_logreg,
            "the digits upsampled to 28x28: scaler + logistic regression 784 -> 10",
        ),
        "cancer": (
            lambda: datasets.load_breast_cancer(return_X_y=True),
            lambda: GradientBoostingClassifier(n_estimators=50, max_depth=3, random_state=0),
            "gradient-boosted trees (50, depth 3), Wisconsin breast cancer data",
        ),
    }


@dataclass
class Fitted:
    """An example function's fitted scikit-learn estimator and its held-out rows."""

    estimator: Any
    what: str
    train_size: int
    x_test: np.ndarray[Any, Any]
    y_test: np.ndarray[Any, Any]


def fit_function_model(name: str) -> Fitted:
    data, make, what = _function_recipes()[name]
    x, y = data()
    xtr, ytr, xte, yte = _split4(x, y)
    model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convergence chatter
        model.fit(xtr, ytr)
    return Fitted(model, what, len(ytr), xte, yte)


def sklearn_function(
    name: str, input_name: str, fitted: Fitted | None = None
) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """An example function's scikit-learn model as skl2onnx exports it, and its report."""
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType

    fitted = fitted or fit_function_model(name)
    model, xte, yte = fitted.estimator, fitted.x_test, fitted.y_test
    final = model.steps[-1][1] if hasattr(model, "steps") else model
    onx = to_onnx(
        model,
        initial_types=[(input_name, FloatTensorType([None, xte.shape[1]]))],
        options={id(final): {"zipmap": False}},  # probabilities as a tensor, not a list of maps
        target_opset={"": 17, "ai.onnx.ml": 3},
    )
    onx.graph.name = name
    report = {
        "model": fitted.what,
        "train_size": fitted.train_size,
        "sklearn_heldout_accuracy": round(float(model.score(xte, yte)), 4),
        "heldout": {"x": xte.tolist(), "y": yte.tolist()},
    }
    return onx, report


def prepare_function(out: Path, manifest: Path = Path("function.toml")) -> dict[str, Any]:
    """What an example function's train.py does in its staging folder: write the model its
    function.toml names into `out`, and `out/build-report.json` (with held-out rows)."""
    import json
    import tomllib

    spec = tomllib.loads(manifest.read_text())
    name, file_name, input_name = spec["name"], spec["model"], spec["inputs"][0]["name"]
    if name == "digits-cnn":  # saved with its weights in external data, as PyTorch does
        from sklearn.datasets import load_digits

        example = cnn_example(out, input_name, file_name)
        x, y = load_digits(return_X_y=True)
        _, _, _, yte = _split4(x / 16.0, y)
        report: dict[str, Any] = {
            "model": "CNN: conv 3x3x8 + relu + maxpool 2 + dense 10, numpy-trained",
            "heldout": {"x": example.x.tolist(), "y": yte.tolist()},
        }
    else:
        model, report = sklearn_function(name, input_name)
        (out / file_name).write_bytes(model.SerializeToString())
    report = {"dataset": f"scikit-learn's bundled data ({name})", **report}
    (out / "build-report.json").write_text(json.dumps(report))
    return report
