"""Streaming through a state: constant memory, and chunked prefill against one prefill.

Two measurements of issue 22's targets, on a ``TransformerLM`` (byte vocabulary, float32,
batch of 1, ``torch.inference_mode``), each continuing its ``DecodingCache`` from chunk to
chunk with ``model.prefill(chunk, cache=cache)``:

* ``rss``: peak resident memory of a fresh process that streams ``N`` tokens through a
  2-layer aft-decay model (d_model 256) in chunks of 4096, for N = 64k and 1M (target: the 1M
  peak within 1.1x of the 64k one). Each N runs in its own process (``ru_maxrss`` is a process's
  high-water mark).
* ``chunked``: prefill of 16k tokens in 4k chunks against one 16k prefill (target: <= 1.15x),
  for aft-simple, aft-decay and aft-local (4 layers, d_model 256), timed alternately after a
  warm-up, by the wall clock and by this process's CPU time; each ratio is of the fastest calls.

    python benchmarks/streaming.py rss [--tokens 65536,1048576] [--chunk 4096] [--threads 2]
    python benchmarks/streaming.py chunked [--length 16384] [--chunk 4096] [--repeats 3]
        [--mixers aft-simple,aft-decay,aft-local] [--threads 2]
"""

import argparse
import resource
import subprocess
import sys
import time

import torch

from aftlab.models import TransformerConfig, TransformerLM


def _model(mixer: str, layers: int, d_model: int, max_seq_len: int) -> TransformerLM:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=256, d_model=d_model, n_layers=layers, n_heads=4, max_seq_len=max_seq_len,
        mixer=mixer, positional="none",
    )
    return TransformerLM(cfg).eval()


def chunks(tokens: int, chunk: int):
    """The benchmark's byte ids, ``(1, chunk)`` pieces (the last shorter), seeded."""
    gen = torch.Generator().manual_seed(0)
    for start in range(0, tokens, chunk):
        yield torch.randint(0, 256, (1, min(chunk, tokens - start)), generator=gen)


@torch.inference_mode()
def stream(model: TransformerLM, tokens: int, chunk: int):
    """Feed ``tokens`` ids (:func:`chunks`) through ``model``, carrying the cache; return
    ``(last logits (1, 1, vocab), cache)``."""
    logits, cache = None, None
    for idx in chunks(tokens, chunk):
        logits, cache = model.prefill(idx, cache=cache, logits_to_keep=1)
    return logits, cache


def peak_rss_mib() -> float:
    """This process's peak resident set size in MiB (Linux: ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss(a: argparse.Namespace) -> None:
    sizes = [int(x) for x in a.tokens.split(",")]
    print(
        f"streaming through 2-layer aft-decay, d_model 256, chunks of {a.chunk}, float32, "
        f"{a.threads} threads, torch {torch.__version__}: peak RSS of a fresh process"
    )
    peaks = {}
    for n in sizes:
        out = subprocess.run(
            [sys.executable, __file__, "_one", str(n), str(a.chunk), str(a.threads)],
            check=True, capture_output=True, text=True,
        ).stdout.split()
        peaks[n] = float(out[0])
        print(f"  {n:>9,} tokens: peak RSS {peaks[n]:7.1f} MiB, {float(out[1]):6.1f} s", flush=True)
    lo, hi = min(sizes), max(sizes)
    print(f"  ratio {hi:,} / {lo:,} tokens: {peaks[hi] / peaks[lo]:.3f} (target <= 1.1)")


def _one(n: int, chunk: int, threads: int) -> None:
    torch.set_num_threads(threads)
    model = _model("aft-decay", 2, 256, chunk)
    t0 = time.perf_counter()
    stream(model, n, chunk)
    print(peak_rss_mib(), time.perf_counter() - t0)


def timed(fn) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of one call of ``fn``."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def chunked(a: argparse.Namespace) -> None:
    T, C = a.length, a.chunk
    print(
        f"chunked prefill ({T} tokens in chunks of {C}) vs one prefill: B=1, 4 layers, "
        f"d_model 256, float32, {a.threads} threads, torch {torch.__version__}"
    )
    for name in a.mixers.split(","):
        print(_chunked_line(name, T, C, a.repeats), flush=True)


def _chunked_line(name: str, T: int, C: int, repeats: int) -> str:
    """One mixer's line: one prefill of ``T`` tokens against ``T / C`` chunked prefills."""
    model = _model(name, 4, 256, T)
    idx = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))

    @torch.inference_mode()
    def whole():
        model.prefill(idx, logits_to_keep=1)

    @torch.inference_mode()
    def in_chunks():
        cache = None
        for s in range(0, T, C):
            _, cache = model.prefill(idx[:, s : s + C], cache=cache, logits_to_keep=1)

    whole(), in_chunks()  # warm-up (and kernel build, if any)
    one = parts = (float("inf"), float("inf"))
    for _ in range(repeats):  # alternate, so slow phases of the machine hit both
        one = tuple(map(min, one, timed(whole)))
        parts = tuple(map(min, parts, timed(in_chunks)))
    return (
        f"  {name:12s} wall: one {one[0] * 1e3:8.1f} ms, chunked {parts[0] * 1e3:8.1f} ms, "
        f"ratio {parts[0] / one[0]:4.2f} | cpu: one {one[1] * 1e3:8.1f} ms, "
        f"chunked {parts[1] * 1e3:8.1f} ms, ratio {parts[1] / one[1]:4.2f}"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_one":
        _one(*(int(x) for x in sys.argv[2:5]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("rss", help="peak RSS streaming 64k vs 1M tokens")
    r.add_argument("--tokens", default="65536,1048576")
    r.add_argument("--chunk", type=int, default=4096)
    r.add_argument("--threads", type=int, default=2)
    c = sub.add_parser("chunked", help="chunked prefill vs one prefill")
    c.add_argument("--length", type=int, default=16384)
    c.add_argument("--chunk", type=int, default=4096)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--mixers", default="aft-simple,aft-decay,aft-local")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    (rss if a.what == "rss" else chunked)(a)


if __name__ == "__main__":
    main()
