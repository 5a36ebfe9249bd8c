"""Diagnostics for the CUDA graphs: capture every decode and prefill bucket and compare each replay with the
eager step.

    python -m deltaserve.tools.capture_check --model DIR [--device cuda|cpu] [--tp N] [--buckets 1,2,4,...]
        [--load-format safetensors|random] [--context 512] [--dot DIR] [--speculative-tokens K]

Per bucket: graph nodes, graph memory (private pool growth), capture time, max |replay - eager| over the live
rows' logits, eager and replay step times and the speed-up. A prefill bucket replays a one-chunk prefill of 7/8
of its tokens, padded to the bucket, against the same padded inputs run eagerly; its speed-up is against the
chunk prefilled eagerly unpadded, as without the graph. Exit status 1 on any capture failure or mismatch. On
the CPU there are no graphs: it says so and checks that each decode bucket's batched eager step equals running its
rows one at a time, and each prefill bucket's padded inputs, run eagerly, the chunk alone. With
--speculative-tokens K each decode bucket's speculative step ("verify" rows, beside its one-token step) is checked
the same way against its program run eagerly (on the CPU: against itself, run again from the same state). Where
fused mixed steps are on (CUDA's default; on the CPU with prefill buckets), each prompt-token bucket's mixed step
(beside the decode buckets in turn: live rows, with a speculative engine's roll-back, and a chunk of 7/8 of the
bucket) is checked against the same padded inputs run eagerly; on the CPU, against its decode rows and its chunk
run apart.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

from dataclasses import fields

import torch

from deltaserve.model.batch import DecodeBatch, MixedBatch, PrefillBatch, PrefillChunk, upload
from deltaserve.devices.replica import mixed_graph_buckets
from deltaserve.runtime import AsyncEngine, EngineArgs
from deltaserve.tools.live_rows import fill_live_rows, restore, snapshot

log = logging.getLogger("capture_check")


def time_per_call(fn, device, iters: int = 20) -> float:
    """Seconds per call (CUDA events on the current stream; wall clock on the CPU)."""
    fn()
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def check_bucket(rank_objs, bucket: int, context: int, dot_dir: str | None, rank: int) -> dict:
    backend, model, runtime = rank_objs.backend, rank_objs.model, rank_objs.runtime
    rows = bucket
    fill_live_rows(runtime, rows, bucket, context, seed=bucket)
    if runtime.speculation:  # rows whose last step kept everything: the one-token graph rolls nothing back
        runtime.speculation.fill_inert()
    batch = runtime.inputs.batch(bucket)
    saved = snapshot(runtime.state)
    eager = model.decode(runtime.state, batch)[:rows].float().clone()
    restore(runtime.state, saved)
    graphs = getattr(backend, "graphs", None)
    result = {"bucket": bucket}
    if graphs is None:  # CPU: the batched eager step against one row at a time
        singles = []
        for r in range(rows):
            restore(runtime.state, saved)
            row = DecodeBatch(*(getattr(batch, f.name)[r : r + 1] for f in fields(DecodeBatch)))
            singles.append(model.decode(runtime.state, row)[0].float())
        restore(runtime.state, saved)
        reference = torch.stack(singles)
        result["diff"] = (reference - eager).abs().max().item()
        result["scale"] = reference.abs().max().item()
        fill_live_rows(runtime, rows, bucket, context, seed=bucket)
        result["eager_s"] = time_per_call(lambda: model.decode(runtime.state, runtime.inputs.batch(bucket)), backend.device, 3)
        return result
    if not graphs.captured(bucket):
        result["failed"] = True
        return result
    replay = graphs(bucket)[:rows].float().clone()
    backend.stream.synchronize()
    restore(runtime.state, saved)
    result["diff"] = (replay - eager).abs().max().item()
    result["scale"] = eager.abs().max().item()
    result.update(graphs.stats[bucket])
    result["eager_s"] = time_per_call(lambda: model.decode(runtime.state, batch), backend.device)
    result["replay_s"] = time_per_call(lambda: graphs(bucket), backend.device)
    restore(runtime.state, saved)
    if dot_dir and rank == 0:
        os.makedirs(dot_dir, exist_ok=True)
        graphs.dot(bucket, os.path.join(dot_dir, f"decode_bucket{bucket}.dot"))
    return result


def check_speculative_bucket(rank_objs, bucket: int, context: int, dot_dir: str | None, rank: int) -> dict:
    """A speculative step (roll-back, drafts, verify of k + 1 tokens a row) over `bucket` live rows that kept a
    random number of their last step's tokens. With graphs: the replay against the program run eagerly from the
    same state (first positions' logits, the others', and the drafts exactly). On the CPU: the program run twice
    from the same state agrees with itself (it reads nothing it has not written or been given) and is finite."""
    backend, runtime = rank_objs.backend, rank_objs.runtime
    fill_live_rows(runtime, bucket, bucket, context, seed=bucket, lookahead=runtime.state.verify_steps)
    runtime.speculation.use_override[:bucket] = False
    rows = rows_after_a_verify_step(runtime, bucket, seed=bucket)
    saved = [pool.clone() for pool in rows]

    def put_back():
        for pool, copy in zip(rows, saved):
            pool.copy_(copy)

    program = runtime.speculative_program(bucket)
    graphs = getattr(backend, "speculative_graphs", None)
    result = {"bucket": bucket}
    if graphs is not None and not graphs.captured(bucket):
        result["failed"] = True
        return result
    first, others, drafts = (t.float().clone() for t in program())
    put_back()
    got = graphs(bucket) if graphs is not None else program()
    got = [t.float().clone() for t in got]
    put_back()
    result["diff"] = max((got[0] - first).abs().max().item(), (got[1] - others).abs().max().item())
    result["scale"] = first.abs().max().item()
    if not torch.equal(got[2], drafts) or not torch.isfinite(first).all():
        result["diff"] = float("inf")  # different drafts: a mismatch whatever the logits
    result["eager_s"] = time_per_call(program, backend.device, 3 if graphs is None else 10)
    put_back()
    if graphs is not None:
        result.update(graphs.stats[bucket])
        result["replay_s"] = time_per_call(lambda: graphs(bucket), backend.device)
        put_back()
        if dot_dir and rank == 0:
            os.makedirs(dot_dir, exist_ok=True)
            graphs.dot(bucket, os.path.join(dot_dir, f"speculative_bucket{bucket}.dot"))
    return result


def rows_after_a_verify_step(runtime, rows: int, seed: int) -> list[torch.Tensor]:
    """Live rows `rows` as after a verify step that kept a random number of its tokens (row 0 one: it rolls back),
    with random step states, hidden states and drafts. Returns the rows' entries of every pool a speculative or
    one-token step reads and writes (layers first in the GDN pools)."""
    state, spec, k = runtime.state, runtime.speculation, runtime.state.verify_steps
    kept = torch.randint(1, k + 2, (rows,), generator=torch.Generator().manual_seed(seed))
    kept[0] = 1
    spec.accepted[:rows].copy_(kept)
    spec.keep[:rows].copy_(kept)
    pools = [state.conv[:, :rows], state.ssm[:, :rows], state.conv_steps[:, :rows], state.ssm_steps[:, :rows],
             state.verify_hidden[:rows], state.drafts[:rows]]
    for pool in pools[2:]:
        pool.copy_(torch.randint_like(pool, 0, runtime.vocab) if pool.dtype == torch.long
                   else torch.randn_like(pool) * 0.1)
    return pools


def check_prefill_bucket(rank_objs, bucket: int, dot_dir: str | None, rank: int) -> dict:
    """A one-chunk prefill of 7/8 of the bucket. With graphs: the replay against the same padded inputs run eagerly
    (the same shapes, so the same rounding), timed against the chunk prefilled eagerly unpadded, as it would be
    without the graph. On the CPU: the padded inputs run eagerly against the chunk alone."""
    backend, model, runtime = rank_objs.backend, rank_objs.model, rank_objs.runtime
    state = runtime.state
    graphs = getattr(backend, "prefill_graphs", None)
    programs = runtime.prefill_programs([bucket]) if graphs is None else None
    slot, n = runtime.max_batch, max(1, bucket * 7 // 8)  # the first prefill slot; the padding request runs too
    ids = torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(bucket)).tolist()
    chunk = PrefillChunk(ids, 0, slot, list(range(-(-n // state.page_size))))

    def unpadded():
        return model.prefill(state, PrefillBatch.build([chunk], state.page_size, state.trash_page, backend.device))

    def padded(replay: bool):
        state.reset_slot(slot)
        head = (ids[1:] + [0], [slot]) if runtime.speculation else ()  # a speculative engine's head inputs
        runtime.prefill_inputs.fill([chunk], bucket, *head)
        if replay:
            return graphs(bucket)
        return programs[bucket]() if programs else model.prefill(state, runtime.prefill_inputs.batch(bucket))

    result = {"bucket": bucket}
    if graphs is not None and not graphs.captured(bucket):
        result["failed"] = True
        return result
    saved = snapshot(state)
    want = (unpadded() if graphs is None else padded(replay=False))[0].float().clone()
    restore(state, saved)
    got = padded(replay=graphs is not None)[0].float().clone()
    restore(state, saved)
    result["diff"] = (got - want).abs().max().item()
    result["scale"] = want.abs().max().item()
    result["eager_s"] = time_per_call(unpadded, backend.device, 3 if graphs is None else 20)
    if graphs is not None:
        result.update(graphs.stats[bucket])
        result["replay_s"] = time_per_call(lambda: padded(replay=True), backend.device)
        if dot_dir and rank == 0:
            os.makedirs(dot_dir, exist_ok=True)
            graphs.dot(bucket, os.path.join(dot_dir, f"prefill_bucket{bucket}.dot"))
    restore(state, saved)
    return result


def check_mixed_bucket(rank_objs, bucket: tuple[int, int], context: int, dot_dir: str | None, rank: int) -> dict:
    """A fused mixed step of `bucket` = (decode rows, prompt tokens): live decode rows (with speculation, having
    kept a random number of their last verify step's tokens) beside a fresh chunk of 7/8 of the token bucket, on
    pages no row holds. With graphs: the replay against the same padded inputs run eagerly. On the CPU: the padded
    inputs run eagerly against the decode rows' one-token step and the chunk's prefill, apart."""
    backend, model, runtime = rank_objs.backend, rank_objs.model, rank_objs.runtime
    state, spec, (rows, tokens) = runtime.state, runtime.speculation, bucket
    k = state.verify_steps
    fill_live_rows(runtime, rows, rows, context, seed=rows * 1000 + tokens, lookahead=k)
    pools = rows_after_a_verify_step(runtime, rows, seed=tokens) if spec else \
        [state.conv[:, :rows], state.ssm[:, :rows]]
    saved = [pool.clone() for pool in pools]
    slot, n = runtime.max_batch, max(1, tokens * 7 // 8)  # the first prefill slot
    held = set(runtime.inputs.table_host[:rows].flatten().tolist())
    free = [p for p in range(state.num_pages) if p not in held]
    ids = torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(tokens)).tolist()
    chunk = PrefillChunk(ids, 0, slot, free[: -(-n // state.page_size)])
    following = ids[1:] + [0]
    graphs = getattr(backend, "mixed_graphs", None)
    if graphs is None:  # the CPU: padded inputs of this bucket, run eagerly
        runtime.prefill_programs([tokens], 1)
        program = runtime.mixed_programs([rows], [tokens])[bucket]

    def put_back():
        for pool, copy in zip(pools, saved):
            pool.copy_(copy)
        state.reset_slot(slot)

    def padded(replay: bool):
        put_back()
        runtime.prefill_inputs.fill([chunk], tokens, *((following, [slot]) if spec else ()))
        if replay:
            return graphs(bucket)
        if graphs is None:
            return program()
        batch = MixedBatch.of(runtime.inputs.batch(rows), runtime.prefill_inputs.batch(tokens))
        if spec:
            return runtime._mixed_with_head(batch, *runtime.prefill_inputs.head_inputs(tokens))
        return model.mixed(state, batch)

    def apart():
        put_back()
        decode = runtime._plain_decode(runtime.inputs.batch(rows), rows)
        batch = PrefillBatch.build([chunk], state.page_size, state.trash_page, backend.device)
        if spec:
            head = upload({"following": following, "rows": [slot]}, torch.long, backend.device)
            return decode, runtime._prefill_with_head(batch, head["following"], head["rows"])
        return decode, model.prefill(state, batch)

    result = {"bucket": f"{rows}x{tokens}"}
    if graphs is not None and not graphs.captured(bucket):
        result["failed"] = True
        return result
    want = [t[:m].float().clone() for t, m in zip(apart() if graphs is None else padded(replay=False), (rows, 1))]
    got = [t[:m].float().clone() for t, m in zip(padded(replay=graphs is not None), (rows, 1))]
    result["diff"] = max((g - w).abs().max().item() for g, w in zip(got, want))
    result["scale"] = max(w.abs().max().item() for w in want)
    result["eager_s"] = time_per_call(apart, backend.device, 3 if graphs is None else 10)
    if graphs is not None:
        result.update(graphs.stats[bucket])
        result["replay_s"] = time_per_call(lambda: padded(replay=True), backend.device, 10)
        if dot_dir and rank == 0:
            os.makedirs(dot_dir, exist_ok=True)
            graphs.dot(bucket, os.path.join(dot_dir, f"mixed_bucket{rows}x{tokens}.dot"))
    put_back()
    return result


def report(kind: str, bucket: "int | str", r: dict, tolerance: float) -> bool:
    """Print a bucket's row; True when it failed (capture refused, or a mismatch)."""
    if r.get("failed"):
        print(f"{kind:>7} {bucket:>6}  CAPTURE FAILED (bucket runs eagerly)")
        return True
    rel = r["diff"] / max(r["scale"], 1e-12)
    bad = rel > tolerance
    nodes = r.get("nodes", "-")
    mib = f"{r['pool_bytes'] / 2**20:.1f}" if "pool_bytes" in r else "-"
    cap = f"{r['capture_s']:.3f}" if "capture_s" in r else "-"
    replay = f"{r['replay_s'] * 1e3:.3f}" if "replay_s" in r else "-"
    speed = f"{r['eager_s'] / r['replay_s']:.2f}x" if "replay_s" in r else "-"
    print(f"{kind:>7} {bucket:>6} {nodes!s:>6} {mib:>9} {cap:>9} {r['diff']:>10.3g} {rel:>8.2g} "
          f"{r['eager_s'] * 1e3:>9.3f} {replay:>9} {speed:>8}{'  MISMATCH' if bad else ''}")
    return bad


async def run(ns) -> int:
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    buckets = [int(b) for b in ns.buckets.split(",")] if ns.buckets else None
    args = EngineArgs(model=ns.model, device=device, tp=ns.tp, cuda_graph=True, buckets=buckets,
                      max_batch=max(buckets) if buckets else ns.max_batch, max_model_len=ns.context * 2,
                      load_format=ns.load_format, dtype=ns.dtype, prefill_slots=1,
                      prefill_graph_tokens=ns.prefill_tokens, enable_prefix_caching=False,
                      speculative_tokens=ns.speculative_tokens,
                      fused_mixed_steps=True if device != "cuda" and ns.prefill_tokens else None)
    if device != "cuda":
        print("CUDA graphs need a CUDA device: checking the batched eager decode path only.")
    async with AsyncEngine(args) as engine:
        replica = engine.replica
        failures = 0
        print(f"{'kind':>7} {'bucket':>6} {'nodes':>6} {'graph MiB':>9} {'capture s':>9} {'max|diff|':>10} "
              f"{'rel':>8} {'eager ms':>9} {'replay ms':>9} {'speed-up':>8}")
        for bucket in replica.buckets:
            checks = [("decode", check_bucket)]
            if replica.ranks[0].runtime.can_speculate(bucket):
                checks.append(("verify", check_speculative_bucket))
            for kind, check in checks:
                results = await replica.group.call(
                    lambda rank: _on_rank(replica, rank, check, bucket, ns.context, ns.dot), timeout_s=600)
                failures += report(kind, bucket, results[0], ns.tolerance)
        for bucket in replica.prefill_bucket_sizes if ns.prefill_tokens else []:
            results = await replica.group.call(
                lambda rank: _on_rank(replica, rank, check_prefill_bucket, bucket, ns.dot), timeout_s=600)
            failures += report("prefill", bucket, results[0], ns.tolerance)
        if replica.spec.fused_mixed_steps:  # each token bucket once, beside the decode buckets in turn
            tokens = mixed_graph_buckets(replica.prefill_bucket_sizes)
            for i, t in enumerate(tokens):
                bucket = (replica.buckets[i % len(replica.buckets)], t)
                results = await replica.group.call(
                    lambda rank: _on_rank(replica, rank, check_mixed_bucket, bucket, ns.context, ns.dot),
                    timeout_s=600)
                failures += report("mixed", results[0]["bucket"], results[0], ns.tolerance)
    print("OK" if failures == 0 else f"FAILED: {failures} bucket(s)")
    return 1 if failures else 0


def _on_rank(replica, rank, check, *args):
    r = replica.ranks[rank]
    with r.backend.context(), torch.inference_mode():
        return check(r, *args, rank)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--buckets", default=None, help="comma-separated (default: the engine's buckets)")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=512, help="positions of the live rows are near this")
    parser.add_argument("--prefill-tokens", type=int, default=EngineArgs.prefill_graph_tokens,
                        help="prefill buckets up to this many tokens (0: none)")
    parser.add_argument("--load-format", default="safetensors", choices=["safetensors", "random"])
    parser.add_argument("--tolerance", type=float, default=1e-3, help="max |diff| relative to max |logit|")
    parser.add_argument("--dot", default=None, help="write each bucket's graph as DOT into this folder")
    parser.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                        help="check the speculative step (K drafts a row, the checkpoint's MTP head) of every bucket")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(ns))


if __name__ == "__main__":
    sys.exit(main())
