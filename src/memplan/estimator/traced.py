"""Traced coefficients: the activation model of a model_type without an analytic one, fitted to traces of the
real transformers model (inputs/trace.py measures; docs/estimator.md, "Traced coefficients").

For one `TraceKey` (the config, the head, the activations' precision, the attention, full checkpointing or
not, which side of its attention window the sequences are) the model is traced at micro batches
b = 1, 2 and four sequence lengths s. Every saved storage and every moment of the three transient windows is
fitted to

    bytes(b, s) = c0 + c1 s + c2 s^2 + b (x0 + x1 s + x2 s^2)

(affine in b as every activation is; s^2 for eager attention's scores): six unknowns from eight traces, the
two spare ones measure the fit (`Coefficients.fit_error`). A saved storage is matched across the traces by its
place in its region; a window's moments by their op sequence (difflib), since a shape that makes a copy a
no-op at b = 1 adds an event at b = 2. At a workload the window's transient is the largest of its fitted
moments, so a moment that overtakes another at long sequences is found. The windows' storages in order, and each
traced block's forward's and backward's (`TracedBlock`), are kept as sequences for the replay of reserved memory:
each storage's bytes fitted the same way, the events every trace has (`_sequence`).

The coefficients are cached on disk (`cache_dir()`), one JSON file per key, named by a hash of the key (the
config's content and the versions of transformers, torch and this format), and in memory by the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from memplan.estimator.activations import ActivationModel, Tensors, TensorKind
from memplan.estimator.rules import Precision
from memplan.inputs.modelspec import ModelSpec
from memplan.inputs.trace import SAVED

FORMAT = 12  # bump when what is measured or fitted changes: old cache files are then never read
B_POINTS = (1, 2)
SEQ_POINTS = 4
S_UNIT = 1024.0  # s in units of 1024 tokens keeps the fit's columns of one scale
WINDOWS = ("loss_forward", "loss_backward", "layer_backward")
# the loss's ordered storages for the replay (estimator/timeline.py); a block's are its TracedBlock's
LOSS_SEQUENCES = ("loss_forward", "loss_backward")


@dataclass(frozen=True)
class TraceKey:
    """Everything one set of coefficients depends on."""

    config: str  # the transformers config as canonical JSON (ModelSpec.traced_config)
    head: str
    precision: str  # the activations' precision, as its byte widths go: fp32, bf16 (autocast), bf16-pure
    attn: str  # "eager", or "sdpa" (FlashAttention-2 and memplan's flash keep what SDPA's kernels keep)
    # full gradient checkpointing: the last block's backward is traced with it (its recompute), and a decoder runs
    # without its KV cache (transformers turns use_cache off under checkpointing; on otherwise, in training too)
    checkpointed: bool
    beyond_window: bool  # the sequences reach the model's attention window / chunk (activations.sdpa_masked)
    versions: str  # transformers, torch, FORMAT

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class TracedBlock:
    """One block of the traced model as it ran: its saved storages fitted one by one, and its forward's and
    backward's storages in order (`_sequence`; the forward's markers kept where they name those storages)."""

    index: int  # its place among the traced model's blocks (inputs/trace.py Layout.stacks)
    decoder: bool  # an encoder-decoder's decoder block
    layer_type: str  # its layer type ("": the model has none)
    saved: tuple[tuple[float, ...], ...]  # one storage each; their sum as one where the traces' counts differ
    forward: tuple[tuple[int, tuple[float, ...]], ...]
    backward: tuple[tuple[int, tuple[float, ...]], ...]


@dataclass(frozen=True)
class Coefficients:
    """Each fitted storage or moment as its six coefficients (`evaluate`)."""

    layer: tuple[tuple[float, ...], ...]  # one block's saved storages (weighted by the layer types' shares)
    decoder_layer: tuple[tuple[float, ...], ...]
    embed: tuple[tuple[float, ...], ...]
    head: tuple[tuple[float, ...], ...]
    lsm: tuple[bool, ...]  # per head storage: the loss's, freed before the last block's backward
    layer_input: tuple[tuple[float, ...], ...]  # what a checkpointed block keeps (its inputs)
    windows: tuple[tuple[tuple[float, ...], ...], ...]  # per WINDOWS entry: its moments
    fit_error: float  # the largest misfit at the spare traces, relative to the saved bytes there
    seconds: float  # the traces' wall time
    path: str  # the cache file
    # per LOSS_SEQUENCES entry: its storages in order (inputs/trace.py sequence), (n, coefficients) where the n-th
    # is born, (~n, ()) where it dies, (SAVED - k, ()) where the head's k-th saved storage is born
    sequences: tuple[tuple[tuple[int, tuple[float, ...]], ...], ...] = ()
    # every traced block whole, for the replay's blocks it stands for (block_of): the step's lists are the mean
    # layer's, whose storages are each layer type's at its share (Cohere 2's, EXAONE 4's sliding and full layers:
    # sizes no real layer has, which pack into segments as none does), and a stack's first block computes what the
    # others are handed (T5's position bias: the relative-position buckets' int64 s x s transients, 2 MiB each at
    # s 512) and keeps more, which the step counts as one storage with the embeddings (kind FIRST_BLOCK)
    blocks: tuple[TracedBlock, ...] = ()


def cache_dir() -> Path:
    """$MEMPLAN_CACHE_DIR, else $XDG_CACHE_HOME/memplan, else ~/.cache/memplan; the traced/ folder in it."""
    root = os.environ.get("MEMPLAN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "memplan")
    return Path(root) / "traced"


def versions() -> str:
    from importlib.metadata import version

    return f"transformers {version('transformers')}, torch {version('torch')}, format {FORMAT}"


def window(spec: ModelSpec) -> int | None:
    """The shortest attention span a layer has (sliding window, Llama 4's chunk), if any."""
    spans = [w for w in (spec.sliding_window, spec.attention_chunk_size) if w]
    return min(spans) if spans else None


def key_of(spec: ModelSpec, s: int, prec: Precision, attn: str, checkpointed: bool) -> TraceKey:
    # fp16 and bf16 have one width: their traces are the same
    name = prec.name.replace("fp16", "bf16")
    w = window(spec)
    return TraceKey(spec.traced_config, spec.head, name, "eager" if attn == "eager" else "sdpa",
                    checkpointed, bool(w and s >= w), versions())


def seq_points(spec: ModelSpec, beyond: bool) -> tuple[int, ...]:
    """Four sequence lengths on the workload's side of the attention window, within the positions. A sequence as
    long as the window is on its far side: masking_utils materialises the window's mask once the keys reach it
    (_ignore_causal_mask_sdpa: kv_length >= local_attention_size), and the layer saves one more storage (traced:
    cohere2-small, window 128: 20 storages a sliding block at s 127, 21 at 128, 129 and 160; with 128 among the
    near side's points their counts differed and the block was fitted as one 2.8 MiB lump). The far side's points
    start past it (at s = 128 one of them is 4,096 bytes, at 129 and on 5,120)."""
    w, top = window(spec), spec.max_position or 512
    lo, hi = (w + 1, min(top, w + 2048)) if (w and beyond) else (1, min(top, (w or 513) - 1, 512))
    # multiples of 32 where there is room (the memory-efficient kernel pads its log-sum-exp to 32 rows)
    step = 32 if hi // 32 - -(-lo // 32) >= SEQ_POINTS - 1 else 1
    first, last = -(-lo // step), hi // step
    return tuple(step * (first + (last - first) * i // (SEQ_POINTS - 1)) for i in range(SEQ_POINTS))


def _basis(b: np.ndarray, s: np.ndarray) -> np.ndarray:
    s = s / S_UNIT
    return np.stack([np.ones_like(s), s, s * s, b, b * s, b * s * s], axis=-1)


def evaluate(c: tuple[float, ...], b: int, s: int) -> float:
    return float(_basis(np.array([b], float), np.array([s], float))[0] @ np.asarray(c))


def fit(points: list[tuple[int, int]], values: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares of values (P, N) over the points: (coefficients (N, 6), largest relative misfit)."""
    A = _basis(np.array([p[0] for p in points], float), np.array([p[1] for p in points], float))
    coef, *_ = np.linalg.lstsq(A, values, rcond=None)
    miss = np.abs(A @ coef - values)
    scale = np.maximum(np.abs(values).sum(axis=1, keepdims=True), 1.0)
    return coef.T, float((miss / scale).max()) if values.size else 0.0


# -- the activation model at one workload ----------------------------------------------------------------------
def block_of(key: TraceKey, decoder: bool, i: int, layer_type: str) -> int:
    """The traced block that stands for layer i of a stack (decoder: an encoder-decoder's decoder; layer_type:
    the layer's, "" without types): the stack's first for its first, else its own type's, else the stack's
    second (inputs/trace.py traces at least two blocks a stack)."""
    stack = [blk for blk in coefficients(key).blocks if blk.decoder == decoder]
    if i == 0:
        return stack[0].index
    rest = stack[1:] or stack
    return next((blk.index for blk in rest if blk.layer_type == layer_type), rest[0].index)


def activations(key: TraceKey, b: int, s: int, block: int | None = None) -> ActivationModel:
    """The traced counterpart of activations.training_activations at micro batch b and sequence s (no TP, LoRA,
    selective or kernels: the constraints refuse them for traced models); with `block` (block_of) that traced
    block's storages replace the mean layer's list, its forward and backward the layer's sequences."""
    c = coefficients(key)
    last = c.blocks[-1]  # the model's last block: the mean layer's sequences (where its list is the mean's, markers)
    forward, backward = (last.forward if c.layer == last.saved else _unmarked(last.forward)), last.backward
    if block is not None:
        own = next(blk for blk in c.blocks if blk.index == block)
        # a block whose backward a trace missed keeps the last block's (not met: every block's input needs a gradient)
        forward, backward = own.forward, own.backward or backward
        c = replace(c, **{"decoder_layer" if own.decoder else "layer": own.saved})

    def saved(name: str, rows, lsm=()) -> list[Tensors]:
        kinds = list(lsm) + [False] * (len(rows) - len(lsm))
        return [Tensors(f"traced: {name} #{i}", max(0.0, evaluate(r, b, s)),
                        kind=TensorKind.LOG_SOFTMAX if k else TensorKind.OTHER) for i, (r, k) in enumerate(zip(rows, kinds))]

    def moment(name: str) -> list[Tensors]:
        moments = c.windows[WINDOWS.index(name)]
        return [Tensors(f"traced: {name}", max([0.0] + [evaluate(m, b, s) for m in moments]))]

    layer, decoder = saved("block", c.layer), saved("decoder block", c.decoder_layer)
    layer_backward = moment("layer_backward")
    if key.checkpointed:
        # traced with the recompute in it, which the step adds itself: one block's saved tensors (step.py)
        recompute = max(sum(t.nbytes for t in layer), sum(t.nbytes for t in decoder))
        layer_backward = [replace(layer_backward[0], nbytes=max(0.0, layer_backward[0].nbytes - recompute))]
    named = dict(zip(LOSS_SEQUENCES, c.sequences)) | {"layer_forward": forward, "layer_backward": backward}
    sequences = {name: [(n, max(0.0, evaluate(r, b, s)) if r else 0.0) for n, r in q] for name, q in named.items()}
    embed = saved("embeddings", c.embed)
    firsts = len({blk.decoder for blk in c.blocks})
    if firsts and not key.checkpointed:  # checkpointed, the first blocks' more is what they keep into backward
        embed = embed[:len(embed) - firsts] + [replace(t, kind=TensorKind.FIRST_BLOCK) for t in embed[-firsts:]]
    return ActivationModel(
        layer=layer, decoder_layer=decoder, embed=embed, head_saved=saved("head", c.head, c.lsm),
        layer_input=saved("checkpointed block input", c.layer_input),
        layer_backward=layer_backward, layer_core=[], loss_forward=moment("loss_forward"),
        loss_backward=moment("loss_backward"), sequences=sequences)


def note(key: TraceKey, model_type: str) -> str:
    """The line estimate prints for a traced model."""
    return (f"activations: traced coefficients of {model_type} (no analytic model), cached in "
            f"{cache_dir() / f'{key.digest}.json'}")


# -- fitting and the cache ----------------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def coefficients(key: TraceKey) -> Coefficients:
    """The coefficients of one key: from the disk cache, else traced and fitted (seconds) and stored."""
    path = cache_dir() / f"{key.digest}.json"
    try:
        doc = json.loads(path.read_text())
        if doc.get("key") == dataclasses.asdict(key):
            return _from_doc(doc["coefficients"], str(path))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    c = _trace_and_fit(key, str(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": dataclasses.asdict(key), "coefficients": dataclasses.asdict(c)}))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the whole new one
    except OSError:
        pass  # a read-only cache only costs the next process the traces again
    return c


def _from_doc(d: dict, path: str) -> Coefficients:
    t = lambda rows: tuple(tuple(float(x) for x in r) for r in rows)  # noqa: E731
    q = lambda seq: tuple((int(n), tuple(float(x) for x in c)) for n, c in seq)  # noqa: E731
    blocks = tuple(TracedBlock(int(x["index"]), bool(x["decoder"]), str(x["layer_type"]), t(x["saved"]),
                               q(x["forward"]), q(x["backward"])) for x in d["blocks"])
    return Coefficients(t(d["layer"]), t(d["decoder_layer"]), t(d["embed"]), t(d["head"]),
                        tuple(bool(x) for x in d["lsm"]), t(d["layer_input"]),
                        tuple(t(w) for w in d["windows"]), float(d["fit_error"]), float(d["seconds"]), path,
                        tuple(q(seq) for seq in d["sequences"]), blocks)


def _trace_and_fit(key: TraceKey, path: str) -> Coefficients:
    from memplan.inputs.trace import trace_points

    t0 = time.perf_counter()
    layout, runs = trace_points(key)
    points = [(b, s) for b, s, _ in runs]
    plain = [m for _, _, m in runs]
    # under full checkpointing what the step keeps (each block's checkpoint inputs), the loss's and the last
    # block's windows come from the checkpointed traces; a block's saved tensors (its recompute) from the others
    kept = [m.get("checkpointed", m) for m in plain]
    errors: list[float] = []

    def rows(get, ms=kept) -> tuple[tuple[float, ...], ...]:
        vals = [get(m) for m in ms]
        n = len(vals[0])
        if any(len(v) != n for v in vals):  # the region's storages differ between traces: fit their sum
            vals = [[sum(v)] for v in vals]
            n = 1
        if not n:
            return ()
        coef, err = fit(points, np.array(vals, float))
        errors.append(err)
        return tuple(tuple(float(x) for x in r) for r in coef)

    (enc, dec), weights = layout.stacks, layout.weights
    layer = _stack(lambda get: rows(get, plain), enc[1:], weights)
    decoder = _stack(lambda get: rows(get, plain), dec[1:], weights)
    head = rows(lambda m: m["saved"].get("head", []))
    lsm = tuple(kept[0]["lsm"]) if len(head) == len(kept[0]["lsm"]) else ()
    layer_input: tuple[tuple[float, ...], ...] = ()  # read by the step under full checkpointing only
    if key.checkpointed:  # what a checkpointed block keeps: its checkpoint's inputs, at its share of all layers
        n_enc, n_dec = layout.layer_counts
        shares = {k: v * (n_enc if k in enc else n_dec) / (n_enc + n_dec) for k, v in weights.items()}
        layer_input = _stack(rows, enc[1:] + dec[1:], shares)
    # each stack's first block beyond its second (same type): kept once, with the embeddings
    firsts = [rows(lambda m, st=st: [_total(m, st[0]) - _total(m, st[1])]) for st in (enc, dec) if st]
    embed = rows(lambda m: m["saved"].get("embed", [])) + tuple(r[0] for r in firsts)
    windows = tuple(_moments(points, [m["windows"][name] for m in kept]) for name in WINDOWS)
    loss_forward, loss_backward = (_sequence(points, [m["sequences"][name] for m in kept]) for name in LOSS_SEQUENCES)
    # the loss's markers name the head's storages where those were fitted one by one
    if len(head) != len(kept[0]["saved"].get("head", [])):
        loss_forward = _unmarked(loss_forward)
    sequences = (loss_forward, loss_backward)
    blocks = tuple(_block(k, k in dec, layout.types[k] if layout.types else "", lambda get: rows(get, plain), points,
                          kept) for k in enc + dec)
    return Coefficients(layer, decoder, embed, head, lsm, layer_input, windows, max(errors, default=0.0),
                        round(time.perf_counter() - t0, 2), path, sequences, blocks)


def _block(k: int, decoder: bool, layer_type: str, rows, points: list[tuple[int, int]],
           kept: list[dict]) -> TracedBlock:
    """Traced block k whole (TracedBlock): the markers of its forward kept where they name its storages."""
    own = rows(lambda m: m["saved"].get(f"block{k}", []))
    forward = _sequence(points, [m["block_forward"][k] for m in kept])
    if len(own) != len(kept[0]["saved"].get(f"block{k}", [])):
        forward = _unmarked(forward)
    backs = [m["block_backward"].get(k) for m in kept]
    backward = _sequence(points, backs) if all(backs) else ()
    return TracedBlock(k, decoder, layer_type, own, forward, backward)


def _unmarked(seq: tuple) -> tuple:
    """A sequence without its markers, where they would not name the list it is played with."""
    return tuple((n, c) for n, c in seq if n > SAVED)


def _total(m: dict, k: int) -> int:
    return sum(m["saved"].get(f"block{k}", []))


def _stack(rows, blocks: list[int], weights: dict) -> tuple[tuple[float, ...], ...]:
    """The mean block of `blocks`: each traced block's storages at its share (its layer type's)."""
    out: list[tuple[float, ...]] = []
    for k in blocks:
        share = weights[k]
        out += [tuple(x * share for x in r) for r in rows(lambda m, k=k: m["saved"].get(f"block{k}", []))]
    return tuple(out)


def _moments(points: list[tuple[int, int]], series: list[list[tuple[str, int]]]) -> tuple[tuple[float, ...], ...]:
    """A window's moments fitted across the traces: its events matched by op sequence to the first trace's;
    the moments that are the largest somewhere on a grid of workloads kept, and the window's largest value
    fitted as one more moment when it fits (the same moment at every trace)."""
    index, common = _matched([[op for op, _ in ser] for ser in series])
    vals = np.array([[series[j][index[j][i]][1] for i in common] for j in range(len(series))], float)
    peaks = np.array([[max(v for _, v in ser)] for ser in series], float)
    coef, _ = fit(points, vals) if common else (np.zeros((0, 6)), 0.0)
    top, top_err = fit(points, peaks)
    keep = _dominant(coef)
    out = [coef[i] for i in keep] + ([top[0]] if top_err < 1e-3 else [])
    return tuple(tuple(float(x) for x in r) for r in out)


def _matched(ops: list[list[str]]) -> tuple[list[dict[int, int]], list[int]]:
    """Each trace's events matched to the first trace's by op sequence (difflib): per trace, the first's event
    index -> its own; and the first's events every trace matched."""
    index: list[dict[int, int]] = [dict() for _ in ops]
    for j, seq in enumerate(ops):
        sm = difflib.SequenceMatcher(None, ops[0], seq, autojunk=False)
        for blk in sm.get_matching_blocks():
            for d in range(blk.size):
                index[j][blk.a + d] = blk.b + d
    return index, [i for i in range(len(ops[0])) if all(i in ix for ix in index)]


def _sequence(points: list[tuple[int, int]], seqs: list[list]) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """A window's storages in order across the traces: the first trace's events every trace has (matched by op
    sequence), each storage's bytes fitted; a death kept only with its birth."""
    index, common = _matched([[op for op, _, _ in q] for q in seqs])
    born = [i for i in common if seqs[0][i][1] >= 0]
    vals = np.array([[seqs[j][index[j][i]][2] for i in born] for j in range(len(seqs))], float)
    coef = dict(zip(born, fit(points, vals)[0])) if born else {}
    kept = {seqs[0][i][1] for i in born}
    out = []
    for i in common:
        n = seqs[0][i][1]
        if n >= 0:
            out.append((n, tuple(float(x) for x in coef[i])))
        elif n <= SAVED or ~n in kept:
            out.append((n, ()))
    return tuple(out)


def _dominant(coef: np.ndarray) -> list[int]:
    """The moments that are the largest at some workload of a grid (b 1 to 1024, s 64 to 1M tokens)."""
    if not len(coef):
        return []
    b, s = np.meshgrid(2.0 ** np.arange(0, 11), 2.0 ** np.arange(6, 21))
    at = _basis(b.ravel(), s.ravel()) @ coef.T  # (grid, moments)
    return sorted(set(at.argmax(axis=1).tolist()))
