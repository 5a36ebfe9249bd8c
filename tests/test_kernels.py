"""Each Triton kernel against its torch reference.

On the CPU (CI) the kernels run under TRITON_INTERPRET=1 on small shapes in fp32, with fresh random inputs and
every output the op allocates poisoned with NaN first, so an element a kernel forgets to write fails. On a GPU
the same checks run at the real 4B/9B/27B shapes in bf16 (marked gpu).
"""

import contextlib
import subprocess
import sys

import pytest
import torch

from deltaserve.kernels import attention, conv1d, gdn, gemv, launch, norm
from deltaserve.kernels.config import DEFAULT, GDN_FACTOR_MODES, KernelConfig, Tile, WholeRows
from deltaserve.kernels.ops import triton_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ELEMENTWISE, REDUCTION = 1e-5, 1e-4


def rel(a, b):
    a, b = a.float(), b.float()
    assert not torch.isnan(a).any(), "an output element was never written"
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


@contextlib.contextmanager
def poisoned_outputs():
    """Make every floating tensor the ops allocate start as NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_empty(*args, **kw):
        t = empty(*args, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def nan_empty_like(*args, **kw):
        t = empty_like(*args, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty, torch.empty_like = nan_empty, nan_empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("rows,cols", [(1, 48), (7, 64), (5, 200), (70, 64)])  # 70: 4 rows a program on the CPU
def test_rms_norms(rows, cols):
    x, r, w = randn(rows, cols), randn(rows, cols), randn(cols) * 0.2
    with poisoned_outputs():
        got, got_res = norm.add_rms_norm(x, r, w, 1e-6)
        plain = norm.rms_norm(x.view(rows, 1, cols), w, 1e-6)
    ref, ref_res = norm.add_rms_norm_reference(x, r, w, 1e-6)
    assert rel(got, ref) <= REDUCTION and rel(got_res, ref_res) <= ELEMENTWISE
    assert rel(plain, norm.rms_norm_reference(x.view(rows, 1, cols), w, 1e-6)) <= REDUCTION
    with poisoned_outputs():  # no weight: (1 + w) folded into the projection that reads the norm
        unit, unit_res = norm.add_rms_norm(x, r, None, 1e-6)
        plain_unit = norm.rms_norm(x, None, 1e-6)
    ref_unit, _ = norm.add_rms_norm_reference(x, r, None, 1e-6)
    assert rel(unit, ref_unit) <= REDUCTION and rel(unit_res, ref_res) <= ELEMENTWISE
    assert rel(plain_unit, norm.rms_norm_reference(x, None, 1e-6)) <= REDUCTION and rel(unit, ref) > 0.05
    o, z, gw = randn(rows, 3, 32), randn(rows, 3, 32), randn(32)
    with poisoned_outputs():
        got = norm.gated_rms_norm(o, z, gw, 1e-6)
    assert rel(got, norm.gated_rms_norm_reference(o, z, gw, 1e-6)) <= REDUCTION


def test_the_gated_norm_takes_a_prefills_many_rows_several_a_program():
    """A prefill's (token, head) rows are many and short: a program takes several (`launch.rows_per_program`), the
    last program only some; z is read through the fused input projection's strides."""
    device = torch.device(DEVICE)
    heads, d = 4, 32
    tokens = 12 * launch.multiprocessors(device) + 5
    assert launch.rows_per_program(tokens * heads, d, device) == 8 and (tokens * heads) % 8
    assert launch.rows_per_program(heads, d, device) == 1  # a decode row's heads: one a program
    o, projected, w = randn(tokens, heads, d), randn(tokens, 2 * heads * d + 8), randn(d)
    z = projected[:, 8:8 + heads * d].view(tokens, heads, d)
    with poisoned_outputs():
        got = norm.gated_rms_norm(o, z, w, 1e-6)
    assert rel(got, norm.gated_rms_norm_reference(o, z, w, 1e-6)) <= REDUCTION


def test_conv1d_decode_updates_state_through_slots():
    C, K, S = 70, 4, 6
    x, w = randn(4, C), randn(C, K)
    state = randn(S + 1, K - 1, C)
    slots = torch.tensor([3, -1, 0, 5], device=DEVICE)
    ref_state = state.clone()
    with poisoned_outputs():
        got = conv1d.conv1d_decode(x, w, state, slots)
    ref = conv1d.conv1d_decode_reference(x, w, ref_state, slots)
    assert rel(got, ref) <= ELEMENTWISE
    assert torch.equal(state[:S], ref_state[:S])  # live slots written exactly; untouched ones unchanged


@pytest.mark.parametrize("tile", [DEFAULT.conv1d_prefill_tile, (4, 64, 4)])  # 4 tokens: tiles inside a request
def test_conv1d_prefill_continues_each_request_from_its_slot(tile):
    C, K, S = 150, 4, 6
    lens = [1, 2, 5, 40, 3]  # requests shorter than the K-1 state rows read (and keep) part of the old state
    T_ = sum(lens)
    wide = randn(T_, C + 30)
    x = wide[:, 10 : 10 + C]  # a strided view, as the fused projection hands it over
    w = randn(C, K)
    state = randn(S + 1, K - 1, C)
    ref_state = state.clone()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([4, 0, 2, 5, 1], device=DEVICE)
    with poisoned_outputs():
        got = conv1d.conv1d_prefill(x, w, state, cu, slots, cfg=KernelConfig(conv1d_prefill_tile=tile))
    ref = conv1d.conv1d_prefill_reference(x, w, ref_state, cu, slots)
    assert rel(got, ref) <= ELEMENTWISE
    assert torch.equal(state, ref_state)  # new states written exactly; slot 3 and trash untouched


@pytest.mark.parametrize("hk,hv,dk,dv,block_v", [(2, 4, 16, 16, 64), (2, 2, 32, 16, 64), (1, 3, 16, 48, 64),
                                                 (1, 3, 16, 48, 32)])  # dv over two blocks, the second partial
def test_gdn_decode(hk, hv, dk, dv, block_v):
    N, S = 4, 5
    C = 2 * hk * dk + hv * dv
    mixed, a, b = randn(N, C), randn(N, hv), randn(N, hv)
    A_log, dt_bias = torch.rand(hv, device=DEVICE) * 2, torch.rand(hv, device=DEVICE)
    state = randn(S + 1, hv, dk, dv)
    slots = torch.tensor([4, 0, -1, 2], device=DEVICE)
    ref_state = state.clone()
    with poisoned_outputs():
        got = gdn.gdn_decode(mixed, a, b, A_log, dt_bias, state, slots, hk, dk, dv, block_v=block_v)
    ref = gdn.gdn_decode_reference(mixed, a, b, A_log, dt_bias, ref_state, slots, hk, dk, dv)
    assert rel(got, ref) <= REDUCTION
    assert rel(state[:S], ref_state[:S]) <= REDUCTION


@pytest.mark.parametrize("T", [2, 5])
@pytest.mark.parametrize("K", [4, 2])
def test_conv1d_verify_keeps_the_state_after_each_token(T, K):
    """A verify step's T tokens a row in one launch, from the state its last step kept, against the roll-back and T
    decode steps: outputs, the final state in the slot, the state after each earlier token in the step pool;
    padding rows touch only the trash entries."""
    C, S, R = 70, 6, 3
    wide = randn(R * T, C + 20)
    x, w = wide[:, 5 : 5 + C], randn(C, K)  # a strided view, as the fused projection hands it over
    state, steps = randn(S + 1, K - 1, C), randn(S + 1, T - 1, K - 1, C)
    slots = torch.tensor([3, -1, 0], device=DEVICE)
    kept = torch.tensor([1, T, T - 1], device=DEVICE)  # rows 0 and 2 start from their last step's states
    ref_state, ref_steps = state.clone(), steps.clone()
    with poisoned_outputs():
        got = conv1d.conv1d_verify(x, w, state, steps, slots, kept, T)
    ref = conv1d.conv1d_verify_reference(x, w, ref_state, ref_steps, slots, kept, T)
    assert rel(got, ref) <= ELEMENTWISE
    assert torch.equal(state[:S], ref_state[:S]) and torch.equal(steps[:S], ref_steps[:S])


@pytest.mark.parametrize("T", [2, 4])
@pytest.mark.parametrize("hk,hv,dk,dv,block_v", [(2, 4, 16, 16, 64), (1, 3, 16, 48, 64), (1, 3, 16, 48, 32)])
def test_gdn_verify_keeps_the_state_after_each_token(T, hk, hv, dk, dv, block_v):
    R, S = 3, 5
    C = 2 * hk * dk + hv * dv
    mixed = randn(R * T, C)
    ab = randn(R * T, 2 * hv + 3)
    a, b = ab[:, :hv], ab[:, hv + 3 :]  # strided views
    A_log, dt_bias = torch.rand(hv, device=DEVICE) * 2, torch.rand(hv, device=DEVICE)
    state, steps = randn(S + 1, hv, dk, dv), randn(S + 1, T - 1, hv, dk, dv)
    slots = torch.tensor([4, -1, 2], device=DEVICE)
    kept = torch.tensor([T - 1, 1, T], device=DEVICE)  # row 0 starts from its last step's state, row 2 from its slot
    ref_state, ref_steps = state.clone(), steps.clone()
    with poisoned_outputs():
        got = gdn.gdn_verify(mixed, a, b, A_log, dt_bias, state, steps, slots, kept, T, hk, dk, dv, block_v=block_v)
    ref = gdn.gdn_verify_reference(mixed, a, b, A_log, dt_bias, ref_state, ref_steps, slots, kept, T, hk, dk, dv)
    assert rel(got, ref) <= REDUCTION
    assert rel(state[:S], ref_state[:S]) <= REDUCTION and rel(steps[:S], ref_steps[:S]) <= REDUCTION
    assert torch.equal(state[[0, 1, 3]], ref_state[[0, 1, 3]])  # slots no row names are untouched


@pytest.mark.parametrize("T", [2, 5])
def test_roll_back_pool_copies_only_the_rows_that_roll_back(T):
    """A one-token step after a verify step: every layer of a pool (snapshot entries and the trash after the
    slots) takes each row's state after the tokens it kept; rows that kept all T, and slots no row names, stay."""
    L, S, snapshots, shape = 3, 5, 2, (3, 1500)  # a row's state over two blocks of the kernel
    pool, steps = randn(L, S + snapshots + 1, *shape), randn(L, S + 1, T - 1, *shape)
    slots = torch.tensor([4, -1, 1, 2], device=DEVICE)
    kept = torch.tensor([1, T - 1, T, T - 1], device=DEVICE)  # rows 0 and 3 roll back, row 2 keeps its own
    ref = pool.clone()
    gdn.roll_back_pool(pool, steps, slots, kept, T)
    gdn.roll_back_pool_reference(ref, steps, slots, kept, T)
    assert torch.equal(pool, ref)
    assert torch.equal(pool[:, 4], steps[:, 4, 0]) and torch.equal(pool[:, 2], steps[:, 2, T - 2])
    assert not torch.equal(pool[:, 1], steps[:, 1, T - 2])


@pytest.mark.parametrize("nh,nkv", [(4, 4), (4, 2), (6, 2), (8, 2), (6, 1), (3, 1)])
def test_decode_attention_any_group(nh, nkv):
    D, pages = 32, 24
    kc, vc = randn(pages + 1, 16, nkv, D), randn(pages + 1, 16, nkv, D)
    q = randn(3, nh, D)
    table = torch.randint(0, pages, (3, 8), dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([1, 77, 128], device=DEVICE)
    for splits in (1, 3):  # one split; several, some of them empty for the short rows
        with poisoned_outputs():
            got = attention.decode_attention(q, kc, vc, table, lens, D**-0.5, splits=splits)
        assert rel(got, attention.decode_attention_reference(q, kc, vc, table, lens, D**-0.5)) <= REDUCTION
    qg = randn(3, nh, 2 * D)  # the gate as a strided view, as the fused projection gives it
    gate = qg[..., D:]
    with poisoned_outputs():
        got = attention.decode_attention(q, kc, vc, table, lens, D**-0.5, gate)
    assert rel(got, attention.decode_attention_reference(q, kc, vc, table, lens, D**-0.5, gate)) <= REDUCTION


def test_decode_splits_fill_the_gpu_within_the_context():
    cpu = torch.device("cpu")  # counts 4 multiprocessors
    assert attention.decode_splits(1, 1, 10_000, cpu) == 8
    assert attention.decode_splits(1, 1, 100, cpu) == 2  # two blocks of 64 tokens at most
    assert attention.decode_splits(64, 4, 10_000, cpu) == 1


def test_chunked_gdn_reference_matches_the_recurrence():
    torch.manual_seed(0)
    L, H, dk, dv = 150, 3, 16, 8
    q = gdn.l2_normalize(torch.randn(L, H, dk)) * dk**-0.5
    k = gdn.l2_normalize(torch.randn(L, H, dk))
    v, g, beta, S0 = torch.randn(L, H, dv), -torch.rand(L, H), torch.rand(L, H), torch.randn(H, dk, dv)
    o1, s1 = gdn.gdn_recurrent(q, k, v, g, beta, S0)
    o2, s2 = gdn.gdn_chunked(q, k, v, g, beta, S0)
    assert rel(o2, o1) <= REDUCTION and rel(s2, s1) <= REDUCTION


@pytest.mark.parametrize("nh,nkv,D,splits,gated", [(6, 2, 32, 1, True), (4, 4, 16, 1, False), (8, 1, 64, 1, False),
                                                   (6, 2, 32, 3, True), (4, 2, 24, 2, True)])
def test_prefill_attention_over_paged_context(nh, nkv, D, splits, gated):
    """splits: each query block's keys over up to that many programs, one for every 32 cached keys of its request
    (here 1, 2, 2 and 7, at most `splits`), merged after (some splits of a short block have no keys at all); a head
    dim below its power-of-two block masks the loads of the unmasked key blocks too. gated: the output gate, a view
    into each head's [query | gate] rows as the model passes it, applied as the output is stored or merged."""
    pages = 60
    kc, vc = randn(pages + 1, 16, nkv, D), randn(pages + 1, 16, nkv, D)
    lens, contexts = [5, 130, 17, 1], [0, 33, 64, 200]  # several query and key blocks; chunks after cached pages
    q = randn(sum(lens), nh, D)
    cu = torch.tensor([0, 5, 135, 152, 153], dtype=torch.int32, device=DEVICE)
    table = torch.randperm(pages, device=DEVICE)[:56].view(4, 14).to(torch.int32)
    table[0, 1:] = pages  # unused entries point at the trash page
    ctx = torch.tensor(contexts, device=DEVICE)
    gate = randn(sum(lens), nh, 2 * D)[..., D:] * 3 if gated else None
    with poisoned_outputs():
        got = attention.prefill_attention(q, kc, vc, table, cu, ctx, D**-0.5, gate, splits=splits, split_keys=32)
    want = attention.prefill_attention_reference(q, kc, vc, table, cu, ctx, D**-0.5, gate)
    assert rel(got, want) <= REDUCTION
    if gated:  # the gate matters: without it the output is another one
        assert rel(want, attention.prefill_attention_reference(q, kc, vc, table, cu, ctx, D**-0.5)) > 0.1


def test_silu_mul_and_strided_projection_views():
    x = randn(5, 2 * 300)
    with poisoned_outputs():
        got = norm.silu_mul(x)
    assert rel(got, norm.silu_mul_reference(x)) <= ELEMENTWISE
    # GDN decode and the gated norm read a, b and z straight out of the fused input projection.
    hk, hv, dk, dv = 2, 4, 16, 16
    C = 2 * hk * dk + hv * dv
    y = randn(3, C + hv * dv + 2 * hv)
    mixed, z, b, a = y.split([C, hv * dv, hv, hv], dim=1)
    A_log, dt_bias = torch.rand(hv, device=DEVICE), torch.rand(hv, device=DEVICE)
    state = randn(4, hv, dk, dv)
    ref_state = state.clone()
    slots = torch.tensor([0, 2, -1], device=DEVICE)
    mixed_c = mixed.contiguous()
    with poisoned_outputs():
        o = gdn.gdn_decode(mixed_c, a, b, A_log, dt_bias, state, slots, hk, dk, dv)
    ref_o = gdn.gdn_decode_reference(mixed_c, a, b, A_log, dt_bias, ref_state, slots, hk, dk, dv)
    assert rel(o, ref_o) <= REDUCTION and rel(state[:3], ref_state[:3]) <= REDUCTION
    w = randn(dv)
    got = norm.gated_rms_norm(ref_o, z.view(3, hv, dv), w, 1e-6)
    assert rel(got, norm.gated_rms_norm_reference(ref_o, z.view(3, hv, dv), w, 1e-6)) <= REDUCTION
    conv_state = randn(4, 3, C)
    ref_conv = conv_state.clone()
    wc = randn(C, 4)
    with poisoned_outputs():
        got = conv1d.conv1d_decode(mixed, wc, conv_state, slots)
    assert rel(got, conv1d.conv1d_decode_reference(mixed, wc, ref_conv, slots)) <= ELEMENTWISE


@pytest.mark.parametrize("T_", [4, 45])  # 45: a prefill's, several tokens a program, the last program only some
def test_fused_qk_norm_rope_and_cache_write(T_):
    nh, nkv, D, rot = 3, 1, 32, 8
    cos, sin = attention.rope_tables(rot, 1e7, 64, device=DEVICE)
    qkv = randn(T_, (2 * nh + 2 * nkv) * D)
    qn, kn = randn(D) * 0.1, randn(D) * 0.1
    if DEVICE == "cpu":
        assert launch.rows_per_program(T_ * (nh + nkv), D, torch.device(DEVICE)) == (1 if T_ == 4 else 8)
    pos = torch.tensor([0, 9, 33, 63], device=DEVICE) if T_ == 4 else torch.randperm(64, device=DEVICE)[:T_]
    mapping = torch.tensor([3, 17, 40, 2], device=DEVICE) if T_ == 4 else torch.randperm(64, device=DEVICE)[:T_]
    caches = [torch.full((4, 16, nkv, D), float("nan"), device=DEVICE) for _ in range(4)]
    with poisoned_outputs():
        got = attention.qk_norm_rope_cache(qkv, qn, kn, 1e-6, pos, cos, sin, caches[0], caches[1], mapping, nh, nkv)
    ref = attention.qk_norm_rope_cache_reference(qkv, qn, kn, 1e-6, pos, cos, sin, caches[2], caches[3], mapping, nh, nkv)
    assert rel(got, ref) <= REDUCTION
    flat = [c.view(-1, nkv, D)[mapping] for c in caches]
    assert rel(flat[0], flat[2]) <= REDUCTION and torch.equal(flat[1], flat[3])
    untouched = torch.ones(64, dtype=torch.bool, device=DEVICE)
    untouched[mapping] = False
    assert torch.isnan(caches[0].view(-1, nkv, D)[untouched]).all()  # nothing else written
    assert torch.isnan(caches[1].view(-1, nkv, D)[untouched]).all()


def test_the_forward_on_triton_ops_matches_the_reference_forward(tiny_ckpt):
    from helpers import CpuRunner

    if DEVICE != "cpu":
        pytest.skip("covered on the GPU by the engine tests")
    ref, tri = CpuRunner(tiny_ckpt), CpuRunner(tiny_ckpt)
    tri.model.ops = triton_ops()
    prompts = {0: list(range(3, 40)), 1: [7, 8, 9]}
    assert rel(tri.prefill(prompts), ref.prefill(prompts)) <= REDUCTION
    tokens, positions = {0: 5, 1: 6}, {0: 37, 1: 3}
    for _ in range(3):
        got, want = tri.decode(tokens, positions), ref.decode(tokens, positions)
        assert rel(got, want) <= REDUCTION
        tokens = {s: int(want[i].argmax()) for i, s in enumerate(tokens)}
        positions = {s: p + 1 for s, p in positions.items()}


@pytest.mark.parametrize("ops", ["reference", "triton"])
def test_a_mixed_step_in_one_forward_equals_its_decode_then_its_prefill(tiny_ckpt, ops):
    """The decode rows and the prompt chunks of a step share one pass over the weights (`StepBatch`): the logits,
    and every GDN, conv and KV state after it, are what the decode then the prefill give, on either ops."""
    from helpers import CpuRunner, prompt_logits

    from deltaserve.model.batch import PrefillChunk, PromptChunks, StepBatch

    if DEVICE != "cpu" and ops == "reference":
        pytest.skip("the reference ops on the CPU are CI's")
    apart, together = CpuRunner(tiny_ckpt, device=DEVICE), CpuRunner(tiny_ckpt, device=DEVICE)
    for runner in (apart, together):
        if ops == "triton":
            runner.model.ops = triton_ops()
        runner.prefill({0: list(range(3, 40)), 1: [7, 8, 9], 2: list(range(100, 120))})  # three decoding requests
        runner.prefill({4: list(range(200, 230))})  # a prompt half done: its next chunk resumes at 30

    def step(runner):
        decode = runner.decode_batch({0: 5, 1: 6, 2: 11}, {0: 37, 1: 3, 2: 20})
        chunks = [PrefillChunk(list(range(230, 251)), 30, 4, runner._ensure_pages(4, 51)),
                  PrefillChunk([9, 10, 11, 12, 13], 0, 5, runner._ensure_pages(5, 5))]  # a fresh prompt
        return decode.rows, PromptChunks.build(chunks, 16, runner.state.trash_page, DEVICE)

    rows, chunks = step(apart)
    want_decode = apart.model.logits(apart.model.forward(apart.state, StepBatch.of(rows)))
    want_prefill = prompt_logits(apart.model, apart.state, chunks)
    batch = StepBatch.of(*step(together))
    hidden = together.model.forward(together.state, batch)
    got_decode = together.model.logits(hidden[: batch.row_tokens])
    got_prefill = together.model.logits(hidden[batch.chunk_ends()])
    tolerance = 1e-5 if ops == "reference" else REDUCTION
    vocab = want_decode.shape[1]
    assert got_decode.shape == (3, vocab) and got_prefill.shape == want_prefill.shape == (2, vocab)
    assert rel(got_decode, want_decode) <= tolerance and rel(got_prefill, want_prefill) <= tolerance
    for name in ("conv", "ssm", "k_cache", "v_cache"):
        assert len(getattr(together.state, name)) > 0
        for got, want in zip(getattr(together.state, name), getattr(apart.state, name)):
            assert rel(got, want) <= tolerance, name


def _packed_gdn_requests(hk, hv, dk, dv):
    lens = [1, 64, 150, 37]
    T_ = sum(lens)
    C = 2 * hk * dk + hv * dv
    # Slow decay (about -0.05 a token), so a chunk's first rows still weigh on its last and on the state.
    case = dict(mixed=randn(T_, C), a=randn(T_, hv), b=randn(T_, hv), A_log=torch.rand(hv, device=DEVICE) - 3.5,
                dt_bias=torch.rand(hv, device=DEVICE), ssm_state=randn(6, hv, dk, dv) * 0.3,
                cu_seqlens=torch.tensor([0, 1, 65, 215, 252], dtype=torch.int32, device=DEVICE),
                slots=torch.tensor([3, 0, 4, 1], device=DEVICE), num_k_heads=hk, head_k_dim=dk, head_v_dim=dv)
    return case, gdn.GdnChunks.build(case["cu_seqlens"].tolist(), DEVICE)


@pytest.mark.parametrize("hk,hv,dk,dv,column_block", [(2, 4, 16, 16, 32), (1, 2, 32, 16, 32), (1, 2, 32, 16, 16),
                                                      (1, 2, 24, 20, 16),  # heads the tiles overhang: masked
                                                      (2, 4, 8, 12, 64), (1, 2, 8, 8, 8)])  # narrower than a dot
def test_chunked_gdn_prefill_over_packed_requests(hk, hv, dk, dv, column_block):
    case, chunks = _packed_gdn_requests(hk, hv, dk, dv)
    assert chunks.spans.tolist() == [[0, 1], [1, 65], [65, 129], [129, 193], [193, 215], [215, 252]]
    assert chunks.first.tolist() == [0, 1, 2, 5, 6]
    state = case["ssm_state"]
    ref_state = state.clone()
    with poisoned_outputs():
        got = gdn.gdn_prefill(**case, chunks=chunks,  # 16: the prep kernel loops over two column blocks
                            prep_config=(4, 1, column_block, DEFAULT.gdn_prep[3]))
    ref = gdn.gdn_prefill_reference(**dict(case, ssm_state=ref_state))
    assert rel(got, ref) <= REDUCTION
    assert rel(state[:5], ref_state[:5]) <= REDUCTION
    assert torch.equal(state[2], ref_state[2])  # a slot no request uses is untouched
    with pytest.raises(ValueError, match="columns"):
        gdn.gdn_prefill(**dict(case, mixed=case["mixed"][:, 1:]), chunks=chunks)


def test_the_state_pass_config_follows_how_many_programs_the_gpu_holds_at_once():
    cpu = torch.device("cpu")  # four "SMs": multiprocessors() on the CPU
    assert launch.multiprocessors(cpu) == 4
    assert gdn.gdn_scan_config(1, 1, 128, cpu) == DEFAULT.gdn_scan_narrow  # 4 narrow programs fit
    assert gdn.gdn_scan_config(1, 2, 128, cpu) == DEFAULT.gdn_scan_wide  # 8 narrow programs would take turns
    assert gdn.gdn_scan_config(1, 4, 32, cpu) == DEFAULT.gdn_scan_narrow  # one narrow block covers dv 32
    assert gdn.gdn_scan_config(1, 1, 128, cpu, "fp32") == DEFAULT.gdn_scan_fp32_factors  # the one tile measured right
    other = KernelConfig(gdn_scan_narrow=(16, 2, 2))  # a config handed in, not a module global
    assert gdn.gdn_scan_config(1, 1, 32, cpu, cfg=other) == (16, 2, 2)


def test_chunked_gdn_prefill_with_bf16_factors():
    """The WY factors in bf16 (KernelConfig.gdn_factors "bf16", which bf16 models take): formed, stored and applied in bf16. The
    rounding shows, and stays at bf16's scale."""
    case, chunks = _packed_gdn_requests(2, 4, 32, 32)
    ref_case = dict(case, ssm_state=case["ssm_state"].clone())
    ref = gdn.gdn_prefill_reference(**ref_case)
    errors = {}
    for factors in GDN_FACTOR_MODES:
        run = dict(case, ssm_state=case["ssm_state"].clone())
        with poisoned_outputs():
            out = gdn.gdn_prefill(**run, chunks=chunks, factors=factors)
        errors[factors] = rel(out, ref), rel(run["ssm_state"][:5], ref_case["ssm_state"][:5])
    assert max(errors["fp32"]) <= REDUCTION
    assert all(REDUCTION < e <= 2e-2 for e in errors["bf16"]), errors
    with pytest.raises(ValueError, match="factors"):
        gdn.gdn_prefill(**case, chunks=chunks, factors="fp16")


@pytest.mark.parametrize("k", [256, 320, 200])
@pytest.mark.parametrize("n", [24, 5])
def test_one_row_gemv_and_its_routing(k, n, monkeypatch):
    """Both one-row GEMVs against the reference: whole rows (k 256: one span; 320: 256 + 64) and the loop over K
    tiles (two tiles, whole at k 256 and ragged at k 200, which does not split into two spans)."""
    cfg = KernelConfig(gemv_tile=Tile(2, 128, 4, 1))
    x, w = randn(1, k), randn(n, k) * 0.1
    strided = torch.cat([x, x], dim=1)[:, :k]  # a view with a row stride
    splits = k != 200
    assert (gemv.whole_row_spans(k) is not None) == splits
    configs = [cfg.gemv_tile]
    if splits:
        configs += [WholeRows(1, 4)] + ([WholeRows(8, 2)] if n % 8 == 0 else [])
    for config in configs:
        with poisoned_outputs():
            got, got_strided = gemv.gemv(x, w, config=config), gemv.gemv(strided, w, config=config)
        assert rel(got, gemv.linear_reference(x, w)) <= REDUCTION and rel(got_strided, gemv.linear_reference(x, w)) <= REDUCTION, config
    if not splits:
        with pytest.raises(ValueError, match="K \\(200\\)"):
            gemv.gemv(x, w, config=WholeRows(1, 4))
    with pytest.raises(ValueError, match="power of two"):
        gemv.gemv(x, w, config=WholeRows(3, 4))
    # Narrowing: whole rows where K splits and N is a multiple of the rows a program, else the loop.
    assert gemv.gemv_config(n, k, cfg) == (cfg.gemv_whole_rows if splits else cfg.gemv_tile)
    off = KernelConfig(whole_rows=False)  # bench_decode --whole-rows off
    assert gemv.gemv_config(n, k, off) == off.gemv_tile
    assert gemv.norm_gemv_config(n * 2, k, False, off) == off.norm_gemv_tile
    two_rows = KernelConfig(gemv_whole_rows=WholeRows(2, 4))
    assert gemv.gemv_config(n, k, two_rows) == (WholeRows(2, 4) if splits and n % 2 == 0 else two_rows.gemv_tile)
    assert gemv.gemv_config(k + 1, k, two_rows) == DEFAULT.gemv_narrow_widening_tile  # widening a narrow input
    assert gemv.gemv_config(k + 1, DEFAULT.wide_input_k, two_rows) == DEFAULT.gemv_tile  # widening a wide one
    wide = randn(k + 1, k) * 0.1  # the widening tile (512 wide) runs past k: masked
    with poisoned_outputs():
        assert rel(gemv.gemv(x, wide), gemv.linear_reference(x, wide)) <= REDUCTION
    calls = []
    monkeypatch.setattr(gemv, "gemv", lambda x, w, cfg: calls.append(w.shape) or gemv.linear_reference(x, w))
    gemv.linear(x, w)  # one row: the GEMV
    gemv.linear(torch.cat([x, x]), w)  # two rows: cuBLAS
    gemv.linear(x, wide)  # one row, widening: the GEMV too
    gemv.linear(x, w, KernelConfig(gemv_one_row=False))  # bench_decode --gemv off: cuBLAS
    assert calls == [w.shape, wide.shape]


@pytest.mark.parametrize("k, rows", [(256, 16), (256, 10), (320, 16), (200, 16)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("folded", [False, True])
def test_input_norm_fused_into_the_one_row_projection(k, rows, with_residual, folded, monkeypatch):
    """The block's add-and-norm fused into the GEMV that reads it (and silu(gate) * up into the MLP's), against the
    unfused reference, in both kernels: whole rows where K splits into two power-of-two spans (256, 320) and the
    row count allows (10 rows: 5 gate rows, odd, take the loop), the loop over K tiles otherwise; more rows than
    one take the unfused path. 16 rows and k 256 fill every loop tile (no masks). Folded: the norm weight given as
    None and its (1 + w) in the projection's columns, as the model runs, against the reference with both apart."""
    cfg = KernelConfig(norm_gemv_tile=Tile(4, 128, 4, 1),  # two K tiles: whole (k 256) and ragged (k 200)
                       norm_gemv_silu_tile=Tile(4, 128, 4, 1), norm_gemv_whole_rows=WholeRows(2, 4),
                       norm_gemv_silu_whole_rows=WholeRows(2, 2))
    x, nw, w = randn(1, k), randn(k) * 0.2, randn(rows, k) * 0.1  # 10 rows: a ragged last loop program
    res = randn(1, k) if with_residual else None
    splits = k != 200
    assert gemv.norm_gemv_config(rows, k, False, cfg) == (cfg.norm_gemv_whole_rows if splits else cfg.norm_gemv_tile)
    whole_silu = splits and rows // 2 % 2 == 0
    assert gemv.norm_gemv_config(rows // 2, k, True, cfg) == (cfg.norm_gemv_silu_whole_rows if whole_silu
                                                           else cfg.norm_gemv_silu_tile)
    ref, ref_res = gemv.add_rms_norm_linear_reference(x, res, nw, 1e-6, w)
    ref_act = gemv.add_rms_norm_gate_up_reference(x, res, nw, 1e-6, w)[0]
    if folded:
        nw, w = None, w * (1.0 + nw)
    with poisoned_outputs():
        got, got_res = gemv.add_rms_norm_linear(x, res, nw, 1e-6, w, cfg)
        act, act_res = gemv.add_rms_norm_gate_up(x, res, nw, 1e-6, w, cfg)
        loop, _ = gemv.norm_gemv(x, res, nw, 1e-6, w, config=cfg.norm_gemv_tile)
        loop_act, _ = gemv.norm_gemv(x, res, nw, 1e-6, w, rows // 2, config=cfg.norm_gemv_silu_tile)
    assert rel(got, ref) <= REDUCTION and rel(got_res, ref_res) <= ELEMENTWISE
    assert act.shape == (1, rows // 2) and rel(act, ref_act) <= REDUCTION
    assert rel(act_res, ref_res) <= ELEMENTWISE
    assert rel(loop, ref) <= REDUCTION and rel(loop_act, ref_act) <= REDUCTION
    calls = []
    monkeypatch.setattr(gemv, "norm_gemv", lambda *a, **kw: calls.append(kw.get("silu_mul_rows", 0)))
    two = torch.cat([x, x])
    got2, _ = gemv.add_rms_norm_linear(two, None if res is None else torch.cat([res, res]), nw, 1e-6, w)
    assert not calls and rel(got2, torch.cat([ref, ref])) <= REDUCTION
    gemv.add_rms_norm_gate_up(x, res, nw, 1e-6, w)
    assert calls == [rows // 2]
    # From wide_input_k up, or with the fusion off, the norm kernel and the plain GEMV run.
    for unfused in (KernelConfig(wide_input_k=k), KernelConfig(fused_norm=False)):
        got_wide, _ = gemv.add_rms_norm_linear(x, res, nw, 1e-6, w, unfused)
        act_wide, _ = gemv.add_rms_norm_gate_up(x, res, nw, 1e-6, w, unfused)
        assert calls == [rows // 2] and rel(got_wide, ref) <= REDUCTION and rel(act_wide, act) <= REDUCTION


def test_no_barrier_holds_back_the_fused_norm_gemvs_weight_loads():
    """Compiled offline for sm90, no loop of the add-and-norm GEMV holds a barrier: its weight loads issue with the
    input's instead of after a layout change through shared memory. Every kernel of the tool compiles for sm90,
    the prefill attention (its unmasked and masked key loops, with and without split keys) and the merges among
    them: what the interpreter cannot check. The tool runs apart: it compiles, so it imports the kernels without the interpreter this process
    has."""
    table = subprocess.run([sys.executable, "-m", "deltaserve.tools.lab.inspect_kernels"], capture_output=True, text=True,
                           check=True, timeout=300).stderr
    names = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]
    for name in ("prefill_attention, splits 1", "prefill_attention, splits 4", "merge_splits", "merge_splits, counts"):
        assert name in names, table
    attention_loops = [line.split("|")[4] for line in table.splitlines() if line.startswith("| prefill_attention")]
    assert all(len(loops.split(";")) == 2 for loops in attention_loops), table  # the unmasked keys, then the diagonal
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| norm_gemv")]
    assert len(rows) == 2, table
    for row in rows:
        per_loop = [tuple(int(n) for n in loop.split("/")) for loop in row[4].split(";")]
        assert per_loop and all(loads > 0 and barriers == 0 for loads, barriers in per_loop), row


def test_programs_an_sm_holds_follow_the_register_grants():
    """Registers are granted 8 a thread at a time, so 62 and 64
    registers both give 8 programs of 4 warps, 56 give 9, and 100 are granted as 104 (4 programs, not 5); the
    213-register GDN decode held 2, the 168-register one 3; 2-warp programs are capped at 32 an SM, large shared
    memory caps them too."""
    cases = [(62, 0, 4, 8), (64, 0, 4, 8), (56, 0, 4, 9), (100, 0, 4, 4), (94, 0, 4, 5), (80, 0, 4, 6),
             (72, 0, 4, 7), (168, 0, 4, 3), (213, 0, 4, 2), (16, 0, 2, 32), (32, 100_000, 4, 2)]
    code = ("from deltaserve.tools.lab.inspect_kernels import programs_per_sm as p; "
            f"print([p(r, s, w) for r, s, w, _ in {cases}])")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert got.strip() == str([want for *_, want in cases])


def test_knockout_stand_in_skips_every_launch_of_its_kernel():
    """tools/lab/knockout_decode times the step without one kernel: its stand-in must launch nothing and count."""
    from deltaserve.tools.lab.knockout_decode import SkippedLaunches

    o, z, w = randn(3, 2, 16), randn(3, 2, 16), randn(16)
    stand_in, original = SkippedLaunches(), norm._gated_rms_norm_kernel
    norm._gated_rms_norm_kernel = stand_in
    try:
        with poisoned_outputs():
            out = norm.gated_rms_norm(o, z, w, 1e-6)
    finally:
        norm._gated_rms_norm_kernel = original
    assert stand_in.calls == 1 and torch.isnan(out).all()
    assert rel(norm.gated_rms_norm(o, z, w, 1e-6), norm.gated_rms_norm_reference(o, z, w, 1e-6)) <= REDUCTION


def test_an_eager_prefill_batch_places_its_tokens_as_the_graph_inputs_do():
    """The eager batch derives its tokens' positions and KV slots on the device; the graphs' inputs write them on
    the host. Packed chunks with cached starts (mid-page too) and shuffled pages get the same ones from both."""
    from deltaserve.model.batch import PrefillChunk, PrefillInputs, PromptChunks

    page, pages_used, chunks = 16, iter(torch.randperm(200, generator=torch.Generator().manual_seed(0)).tolist()), []
    for slot, (start, n) in enumerate([(0, 37), (16, 1), (21, 60), (200, 16)]):
        pages = [next(pages_used) for _ in range(-(-(start + n) // page))]
        chunks.append(PrefillChunk(list(range(n)), start, slot, pages))
    T = sum(len(c.token_ids) for c in chunks)
    eager = PromptChunks.build(chunks, page, 255, DEVICE)
    inputs = PrefillInputs(128, 16, 7, 255, page, DEVICE, requests=4)
    inputs.fill(chunks, 128)
    graph = inputs.batch(128)
    assert eager.positions.tolist() == graph.positions[:T].tolist()
    assert eager.slot_mapping.tolist() == graph.slot_mapping[:T].tolist()
    assert eager.positions[36:38].tolist() == [36, 16] and eager.slot_mapping[37].item() == chunks[1].pages[1] * 16


# The second pads with an empty GDN chunk; the third fills its bucket (the padding request has no token).
@pytest.mark.parametrize("start,n,bucket", [(0, 37, 64), (16, 64, 128), (20, 32, 32)])
def test_a_padded_one_chunk_prefill_equals_the_chunk_alone(tiny_ckpt, start, n, bucket):
    """What a prefill graph replays: one chunk in `PrefillInputs`' fixed buffers, padded to a bucket of tokens by a
    request in the trash slot and page whose GDN chunks end in empty ones, on the Triton ops (interpreted on the
    CPU). The chunk's logits, its slot's state and its KV pages equal those of the chunk run alone; the padding
    touches nothing but the trash slot and page."""
    from helpers import CpuRunner, prompt_logits

    from deltaserve.model.batch import PrefillChunk, PrefillInputs, PromptChunks
    from deltaserve.model.state import PAGE_SIZE

    runner = CpuRunner(tiny_ckpt, ops=triton_ops(), device=DEVICE)
    prompt = [(7 * i) % 500 + 3 for i in range(start + n)]
    if start:
        runner.prefill({3: prompt[:start]})
    state = runner.state
    pages = runner._ensure_pages(3, start + n)
    chunk = PrefillChunk(prompt[start:], start, 3, pages)
    before = [t.clone() for t in (state.conv, state.ssm, state.k_cache, state.v_cache)]
    alone = prompt_logits(runner.model, state, PromptChunks.build([chunk], PAGE_SIZE, state.trash_page, DEVICE))
    after_alone = [t.clone() for t in (state.conv, state.ssm, state.k_cache, state.v_cache)]
    for t, saved in zip((state.conv, state.ssm, state.k_cache, state.v_cache), before):
        t.copy_(saved)

    inputs = PrefillInputs(128, 12, state.trash_slot, state.trash_page, PAGE_SIZE, DEVICE)
    assert not inputs.fits([PrefillChunk(list(range(bucket + 1)), 0, 3, pages)], bucket)
    if start == 0:
        state.reset_slot(3)  # the rank does this before the replay (a graph's batch has no fresh slots)
    inputs.fill([chunk], bucket)
    padded = prompt_logits(runner.model, state, inputs.batch(bucket))
    assert padded.shape[0] == 2
    assert rel(padded[0], alone[0]) <= REDUCTION
    conv, ssm, k, v = (state.conv, state.ssm, state.k_cache, state.v_cache)
    conv_a, ssm_a, k_a, v_a = after_alone
    assert rel(conv[:, 3], conv_a[:, 3]) <= REDUCTION and rel(ssm[:, 3], ssm_a[:, 3]) <= REDUCTION
    assert rel(k[:, pages], k_a[:, pages]) <= REDUCTION and rel(v[:, pages], v_a[:, pages]) <= REDUCTION
    others = [s for s in range(state.num_slots) if s != 3]
    assert torch.equal(ssm[:, others], ssm_a[:, others]) and torch.equal(conv[:, others], conv_a[:, others])
    untouched = [p for p in range(state.num_pages) if p not in pages]
    assert torch.equal(k[:, untouched], k_a[:, untouched])


def test_packed_chunks_padded_to_a_bucket_equal_them_unpadded(tiny_ckpt):
    """A prefill graph's step of several chunks (one resuming after its cached prefix): three chunks in inputs for
    up to four, padded to 64 tokens by a request in the trash slot and an empty one. Each chunk's logits, its
    slot's state and its KV pages equal those of the same chunks packed without padding; nothing else changes."""
    from helpers import CpuRunner, prompt_logits

    from deltaserve.model.batch import PrefillChunk, PrefillInputs, PromptChunks
    from deltaserve.model.state import PAGE_SIZE

    runner = CpuRunner(tiny_ckpt, ops=triton_ops(), device=DEVICE)
    state = runner.state
    resumed = [(5 * i) % 400 + 9 for i in range(20 + 13)]
    runner.prefill({2: resumed[:20]})
    chunks = [PrefillChunk(resumed[20:], 20, 2, runner._ensure_pages(2, 33))]
    for slot, n in ((3, 21), (4, 9)):
        chunks.append(PrefillChunk([(11 * i + slot) % 300 + 4 for i in range(n)], 0, slot,
                                   runner._ensure_pages(slot, n)))
    tensors = (state.conv, state.ssm, state.k_cache, state.v_cache)
    before = [t.clone() for t in tensors]
    packed = prompt_logits(runner.model, state, PromptChunks.build(chunks, PAGE_SIZE, state.trash_page, DEVICE))
    after_packed = [t.clone() for t in tensors]
    for t, saved in zip(tensors, before):
        t.copy_(saved)

    inputs = PrefillInputs(64, 12, state.trash_slot, state.trash_page, PAGE_SIZE, DEVICE, requests=4)
    assert not inputs.fits(chunks, 32) and not inputs.fits(chunks * 2, 64)  # too many tokens; too many chunks
    for c in chunks[1:]:
        state.reset_slot(c.slot)
    inputs.fill(chunks, 64)
    padded = prompt_logits(runner.model, state, inputs.batch(64))
    assert padded.shape[0] == 5
    assert rel(padded[:3], packed) <= REDUCTION
    slots, pages = [2, 3, 4], sorted({p for c in chunks for p in c.pages})
    for now, want in zip(tensors[:2], after_packed[:2]):
        assert rel(now[:, slots], want[:, slots]) <= REDUCTION
        others = [s for s in range(state.num_slots) if s not in slots]
        assert torch.equal(now[:, others], want[:, others])
    for now, want in zip(tensors[2:], after_packed[2:]):
        assert rel(now[:, pages], want[:, pages]) <= REDUCTION
        assert torch.equal(now[:, [p for p in range(state.num_pages) if p not in pages]],
                           want[:, [p for p in range(state.num_pages) if p not in pages]])


def _fp8_weight(n: int, k: int, seed: int):
    from deltaserve.kernels import fp8
    from deltaserve.model.weights import quantise_fp8

    g = torch.Generator().manual_seed(seed)
    return fp8.Fp8Weight(*quantise_fp8(torch.randn(n, k, generator=g) * 0.05, 128)).to(DEVICE), g


@pytest.mark.parametrize("rows", [1, 5, 37, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_w8a16_projection_equals_its_reference(rows, dtype):
    """The W8A16 kernel (each tile widened in registers, its block's scale on the partial sums) against the weight
    dequantised, at decode and prefill row counts, N and K not multiples of the tiles or the 128-blocks; K of six
    blocks, so the decode rows split it across programs (three splits on the interpreter's four SMs)."""
    from deltaserve.kernels import fp8

    weight, g = _fp8_weight(200, 700, rows)
    if rows <= fp8.DECODE_ROWS:
        assert fp8.decode_tiles(rows, 200, 700, 128, 4 * launch.multiprocessors(torch.device(DEVICE)))[1] > 1 \
            or DEVICE == "cuda"
    x = torch.randn(rows, 700, generator=g).to(DEVICE, dtype)
    ref = fp8.linear_reference(x, weight)
    out = fp8.linear_w8a16(x, weight)
    assert out.dtype == dtype and out.shape == (rows, 200)
    assert rel(out.float(), ref.float()) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prefill_dequantises_each_weight_as_the_format_defines_and_runs_the_gemm_on_it(dtype):
    """The default FP8 prefill (above DECODE_ROWS rows): the weight dequantised by one pass (N and K not
    multiples of the 128-blocks) is exactly `Fp8Weight.dequantise`'s, and the projection is the GEMM over it; an
    fp32 model's rows stay on the W8A16 kernel."""
    from deltaserve.kernels import fp8

    weight, g = _fp8_weight(200, 300, 7)
    assert DEFAULT.fp8_prefill == "dequant"
    ours, want = fp8.dequantised(weight, dtype), weight.dequantise(dtype)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(ours, want)
    else:  # the interpreter truncates fp32 to bf16 where a GPU rounds to nearest: one bf16 step at most
        assert ((ours.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()
    x = torch.randn(fp8.DECODE_ROWS + 6, 300, generator=g).to(DEVICE, dtype)
    got = fp8.linear(x, weight)
    if dtype == torch.bfloat16:
        assert torch.equal(got, x @ ours.t())
    else:
        assert rel(got, fp8.linear_w8a16(x, weight)) <= 1e-6


@pytest.mark.parametrize("tile", [Tile(2, 256, 2, 2), Tile(8, 128, 4, 1), Tile(128, 512, 4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_row_fp8_gemv_equals_its_reference(tile, dtype):
    """The CUDA-core one-row FP8 GEMV (`KernelConfig.fp8_gemv_tile`): a program's rows in one 128-row block, K
    not a multiple of the tile or the blocks (masked), N not of the tile's rows; a tile whose rows straddle two
    blocks is refused."""
    from deltaserve.kernels import fp8

    weight, g = _fp8_weight(200, 700, tile.block_n)
    x = torch.randn(1, 700, generator=g).to(DEVICE, dtype)
    with poisoned_outputs():
        out = fp8.linear_w8a16(x, weight, KernelConfig(fp8_gemv_tile=tile))
    assert out.dtype == dtype and out.shape == (1, 200)
    assert rel(out.float(), fp8.linear_reference(x, weight).float()) <= (1e-5 if dtype == torch.float32 else 1e-2)
    with pytest.raises(ValueError, match="fp8_gemv_tile"):
        fp8.linear_w8a16(x, weight, KernelConfig(fp8_gemv_tile=Tile(96, 128, 4, 1)))


@pytest.mark.parametrize("shape", [(1, 5120, 17408), (8, 5120, 6144), (1, 34816, 5120), (4, 200, 700), (1, 64, 128)])
def test_w8a16_decode_splits_cover_k_in_whole_blocks(shape):
    from deltaserve.kernels import fp8

    m, n, k = shape
    block_n, splits, per_split = fp8.decode_tiles(m, n, k, 128, 4 * 132)
    assert block_n == (64 if n > 34000 else 32)
    assert per_split % 128 == 0 and (splits - 1) * per_split < k <= splits * per_split
    assert splits == 1 or per_split >= 2 * 128  # a split reads two blocks at least
    assert splits == 1 or -(-n // block_n) * splits <= 2 * 4 * 132  # no more programs than it takes


@pytest.mark.parametrize("rows", [65, 100])
def test_the_w8a8_projection_equals_its_reference(rows):
    """FP8 activations (per token and 128 columns) on the FP8 dot: the kernels against the torch arithmetic they
    follow, and that arithmetic within the activations' rounding of the bf16 projection."""
    from deltaserve.kernels import fp8

    weight, g = _fp8_weight(200, 300, rows)
    x = torch.randn(rows, 300, generator=g).to(DEVICE, torch.bfloat16)
    values, scale = fp8.quantise_activations(x, 128)
    ref_values, ref_scale = fp8.quantise_activations_reference(x, 128)
    assert torch.equal(scale, ref_scale)
    if DEVICE == "cuda":  # the interpreter's cast to e4m3 does not round to nearest (7.9 becomes 4.0)
        assert torch.equal(values.float(), ref_values.float())
    matmul = fp8.w8a8_matmul(ref_values, ref_scale, weight, torch.bfloat16)
    ref = fp8.linear_w8a8_reference(x, weight)
    assert matmul.dtype == torch.bfloat16 and rel(matmul.float(), ref.float()) <= 1e-2
    if DEVICE == "cuda":
        assert rel(fp8.linear(x, weight).float(), ref.float()) <= 1e-2  # the default prefill path
    assert rel(ref.float(), fp8.linear_reference(x, weight).float()) <= 0.05


def test_activation_quantisation_pads_rows_and_stores_scales_group_major():
    """The layout cuBLAS's block-scaled GEMM reads: rows padded to a multiple of four with zeros, the scales [rows,
    groups] stored group by group; the live rows as the plain layout has them."""
    from deltaserve.kernels import fp8

    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    values, scale = fp8.quantise_activations(x, 128, rows=8, group_major=True)
    plain_values, plain_scale = fp8.quantise_activations(x, 128)
    assert values.shape == (8, 300) and scale.shape == (8, 3) and scale.stride() == (1, 8)
    assert torch.equal(scale[:5], plain_scale) and torch.equal(values[:5].float(), plain_values.float())
    assert not values[5:].float().any() and (scale[5:] > 0).all()  # zeros, and scales that divide nothing by 0


@pytest.mark.parametrize("tile", [(4, 8, 4), (2, 2, 1), (8, 16, 4)])
def test_activation_quantisation_tiles_cover_every_row_and_group(tile):
    """Tiles of several rows and groups: the last ones partial along rows, groups and K, rows read at a stride
    (a slice of a wider tensor), the padding rows zero, at any tile."""
    from deltaserve.kernels import fp8
    from deltaserve.kernels.config import KernelConfig

    wide = torch.randn(7, 1400, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    x = wide[:, : 128 * 9 + 50]  # ten groups, the last of 50 columns
    cfg = KernelConfig(fp8_quantise_tile=tile)
    values, scale = fp8.quantise_activations(x, 128, rows=10, cfg=cfg)
    ref_values, ref_scale = fp8.quantise_activations_reference(x, 128)
    assert values.shape == (10, x.shape[1]) and scale.shape == (10, 10)
    assert torch.equal(scale[:7], ref_scale) and (scale[7:] > 0).all()
    assert not values[7:].float().any()
    if DEVICE == "cuda":  # the interpreter's cast to e4m3 does not round to nearest
        assert torch.equal(values[:7].float(), ref_values.float())
    else:
        assert torch.equal(values[:7].float().sign(), ref_values.float().sign())


@pytest.mark.parametrize("inner", [128 * 10, 128 * 9 + 40])
def test_the_fused_silu_mul_quantisation_equals_its_reference(inner):
    """silu(gate) * up quantised in one pass, as an FP8 down_proj on cuBLAS reads it: the values and group-major
    scales of the unfused activation quantised (`quantise_activations` of `silu_mul`), the padding rows zero."""
    from deltaserve.kernels import fp8, norm

    gate_up = torch.randn(6, 2 * inner, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    values, scale = fp8.silu_mul_quantised(gate_up, 128, rows=8)
    want_values, want_scale = fp8.quantise_activations(norm.silu_mul(gate_up), 128, rows=8, group_major=True)
    assert scale.stride() == want_scale.stride() and torch.equal(scale, want_scale)
    assert torch.equal(values.float(), want_values.float()) and not values[6:].float().any()
    ref_values, ref_scale = fp8.silu_mul_quantised_reference(gate_up, 128)
    # torch's silu and the kernel's differ in the last bit of a few bf16 activations
    assert rel(scale[:6], ref_scale) <= 1e-2


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("with_weight", [True, False])
def test_the_fused_add_norm_quantisation_equals_its_reference(with_residual, with_weight):
    """A block's input add-and-norm quantised in one pass (the input of an FP8 projection on cuBLAS): the values
    and group-major scales of the unfused norm's output quantised, the new residual the same, the padding rows
    zero; 300 columns (three groups, the last partial)."""
    from deltaserve.kernels import fp8, norm

    g, dtype = torch.Generator().manual_seed(6), torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(6, 300, generator=g).to(DEVICE, dtype)
    residual = torch.randn(6, 300, generator=g).to(DEVICE, dtype) if with_residual else None
    weight = (torch.randn(300, generator=g) * 0.1).to(DEVICE, dtype) if with_weight else None
    values, scale, summed = fp8.add_rms_norm_quantised(x, residual, weight, 1e-6, 128, rows=8)
    normed, want_summed = norm.add_rms_norm(x, residual, weight, 1e-6)
    want_values, want_scale = fp8.quantise_activations(normed, 128, rows=8, group_major=True)
    assert torch.equal(summed, want_summed)
    assert scale.stride() == want_scale.stride() and rel(scale, want_scale) <= 1e-2  # a last bit of the rms
    assert not values[6:].float().any() and (scale[6:] > 0).all()
    ref_values, ref_scale, ref_summed = fp8.add_rms_norm_quantised_reference(x, residual, weight, 1e-6, 128)
    assert torch.equal(summed, ref_summed) and rel(scale[:6], ref_scale) <= 1e-2
    if DEVICE == "cuda":  # the interpreter's cast to e4m3 does not round to nearest
        assert (values[:6].float() != ref_values.float()).float().mean() <= 0.01


@pytest.mark.skipif(DEVICE != "cuda", reason="cuBLAS's block-scaled FP8 GEMM is a CUDA op")
@pytest.mark.parametrize("rows", [20, 130])
def test_the_mlp_with_an_fp8_down_proj_on_cublas_equals_its_reference(rows):
    """The MLP block with FP8 gate_up and down_proj above `fp8_few_rows` rows: down_proj reads the activation
    quantised by the silu(gate) * up pass (`gemv.mlp`), within W8A8's rounding of the reference."""
    from deltaserve.kernels import fp8, gemv

    if not fp8.cublas_block_scaled_works(torch.device(DEVICE)):
        pytest.skip("this GPU or CUDA has no block-scaled FP8 GEMM (sm90, CUDA 12.9+)")
    gate_up, g = _fp8_weight(2 * 1024, 512, rows)
    down, _ = _fp8_weight(512, 1024, rows + 1)
    x = torch.randn(rows, 512, generator=g).to(DEVICE, torch.bfloat16)
    residual = torch.randn(rows, 512, generator=g).to(DEVICE, torch.bfloat16)
    norm_weight = (torch.randn(512, generator=g) * 0.1).to(DEVICE, torch.bfloat16)
    out, summed = gemv.mlp(x, residual, norm_weight, 1e-6, gate_up, down)
    want, want_summed = gemv.mlp_reference(x, residual, norm_weight, 1e-6, gate_up, down)
    assert torch.equal(summed, want_summed)
    assert rel(out.float(), want.float()) <= 0.05  # the activations' FP8 rounding
    act, _ = gemv.add_rms_norm_gate_up(x, residual, norm_weight, 1e-6, gate_up)
    assert rel(out.float(), fp8.linear_cublas(act, down).float()) <= 1e-2  # as quantising apart
    projected, projected_summed = gemv.add_rms_norm_linear(x, residual, norm_weight, 1e-6, gate_up)  # one pass too
    want, _ = gemv.add_rms_norm_linear_reference(x, residual, norm_weight, 1e-6, gate_up)
    assert torch.equal(projected_summed, want_summed) and rel(projected.float(), want.float()) <= 0.05


@pytest.mark.skipif(DEVICE != "cuda", reason="cuBLAS's block-scaled FP8 GEMM is a CUDA op")
@pytest.mark.parametrize("rows", [20, 65, 130, 2048])
def test_the_cublas_fp8_projection_equals_its_reference(rows):
    """The default FP8 projection above `fp8_few_rows` rows (cuBLAS's 1 x 128 by 128 x 128 block-scaled GEMM)
    against the torch arithmetic of W8A8, at row counts that are and are not multiples of four."""
    from deltaserve.kernels import fp8

    if not fp8.cublas_block_scaled_works(torch.device(DEVICE)):
        pytest.skip("this GPU or CUDA has no block-scaled FP8 GEMM (sm90, CUDA 12.9+)")
    weight, g = _fp8_weight(384, 1024, rows)
    assert fp8.cublas_takes(weight) and not fp8.cublas_takes(_fp8_weight(200, 1024, rows)[0])
    x = torch.randn(rows, 1024, generator=g).to(DEVICE, torch.bfloat16)
    got = fp8.linear_cublas(x, weight)
    assert got.shape == (rows, 384) and got.dtype == torch.bfloat16
    assert rel(got.float(), fp8.linear_w8a8_reference(x, weight).float()) <= 1e-2
    assert torch.equal(fp8.linear(x, weight), got)  # the default above fp8_few_rows rows
