"""Device-side inputs of one forward (`StepBatch`): rows that each add one token or a few to a cached sequence
(`TokenRows`: decode and speculative verify rows), prompt chunks (`PromptChunks`), or both.

Built from plain Python lists (what the scheduler hands the workers) by `TokenRows.build` and
`PromptChunks.build`, or read from the fixed-address buffers a CUDA graph captures (`PrefillInputs`, and the
rank's decode inputs); the tensors are what the ops read, the host lists what the reference ops loop over.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from deltaserve.kernels.gdn import GDN_CHUNK, GdnChunks

_ARRAY_CODES = {torch.long: "q", torch.int32: "i", torch.float32: "f"}  # a host buffer's `array` type code by tensor dtype


ALIGN = 16  # elements: each uploaded list starts 64- or 128-byte aligned


def upload(arrays: dict[str, list[int]], dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """The lists as 1-D tensors on `device`, views of one buffer sent in one copy. To a GPU it goes from pinned
    memory without blocking: a copy from pageable memory would first wait for everything queued on the stream (in
    a mixed step, the decode graph just launched), and the prefill's launches with it. Each view starts ALIGN
    elements apart: Triton compiles a kernel again for a pointer that is not 16-byte aligned, which a view at
    an arbitrary offset would be in some steps and not in others."""
    # An array, not a list: a long prompt's list went into a tensor at ~50 ns an element.
    starts, padded = [], array(_ARRAY_CODES[dtype])
    for values in arrays.values():
        starts.append(len(padded))
        padded.extend(values)
        padded.extend(array(padded.typecode, [0]) * (-len(values) % ALIGN))
    flat = torch.frombuffer(padded, dtype=dtype) if padded else torch.empty(0, dtype=dtype)
    if torch.device(device).type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return {name: flat[start : start + len(values)] for (name, values), start in zip(arrays.items(), starts)}


def page_slots(out: array, pages, start: int, end: int, page_size: int) -> None:
    """Append the flat KV slots of positions [start, end) to `out`: a range a page, not a loop over tokens."""
    for j in range(start // page_size, (end - 1) // page_size + 1):
        base = pages[j] * page_size - j * page_size
        out.extend(range(base + max(start, j * page_size), base + min(end, (j + 1) * page_size)))


def select_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`t[rows]` without waiting for the stream: indexing with a host list copies the index from pageable memory,
    which waits for everything queued (the sampler's launches would then start only after the forward)."""
    if rows == list(range(len(rows))):
        return t[: len(rows)]
    return t.index_select(0, upload({"rows": rows}, torch.long, t.device)["rows"])


@dataclass
class PrefillChunk:
    """One request's slice of prompt: tokens at positions start .. start+len, state in `slot`, KV in `pages`."""

    token_ids: list[int]
    start: int
    slot: int
    pages: list[int]

    def check_pages(self, page_size: int) -> None:
        n = len(self.token_ids)
        if (self.start + n + page_size - 1) // page_size > len(self.pages):
            raise ValueError(f"chunk of {n} tokens at {self.start} needs more than its {len(self.pages)} pages")


@dataclass
class PromptChunks:
    """Prompt chunks packed token after token: chunk r is request r's slice of prompt, its tokens
    cu_seqlens[r] .. cu_seqlens[r + 1] of the segment."""


    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    cu_seqlens: torch.Tensor  # [R+1] int32
    slots: torch.Tensor  # [R] long
    context_lens: torch.Tensor  # [R] long: tokens cached before this chunk
    page_table: torch.Tensor  # [R, P] int32
    slot_mapping: torch.Tensor  # [T] long: flat KV index of each token
    last_token: torch.Tensor  # [R] long: index of each request's last token in the packed batch
    fresh_slots: torch.Tensor  # [F] long: slots of requests starting at token 0 (state reset first)
    gdn_chunks: GdnChunks  # the GDN prefill's chunk layout, built here once for every layer

    @classmethod
    def build(cls, chunks: list[PrefillChunk], page_size: int, trash_page: int, device) -> "PromptChunks":
        """The tokens' positions and KV slots are derived on the device from the chunks' starts and page table: on
        the host, an 8k-token prompt's two lists took over a millisecond before the first kernel could launch."""
        ids, cu, last = array("q"), [0], []
        width = max(len(c.pages) for c in chunks)
        table = []
        for c in chunks:
            n = len(c.token_ids)
            if n == 0:
                raise ValueError("a prefill chunk needs at least one token")
            c.check_pages(page_size)
            ids += array("q", c.token_ids)  # a list into an array at once: half the time of extend
            cu.append(cu[-1] + n)
            last.append(cu[-1] - 1)
            table.append(c.pages + [trash_page] * (width - len(c.pages)))

        spans, first = GdnChunks.layout(cu)
        longs = upload({"input_ids": ids, "slots": [c.slot for c in chunks], "context_lens": [c.start for c in chunks],
                        "lengths": [len(c.token_ids) for c in chunks], "last_token": last,
                        "fresh_slots": [c.slot for c in chunks if c.start == 0]}, torch.long, device)
        ints = upload({"cu_seqlens": cu, "page_table": [p for row in table for p in row], "spans": spans,
                       "first": first}, torch.int32, device)
        page_table = ints["page_table"].view(len(chunks), width)
        T = cu[-1]
        request = torch.repeat_interleave(torch.arange(len(chunks), device=device), longs.pop("lengths"),
                                          output_size=T)  # each token's chunk; output_size: no host sync
        positions = torch.arange(T, device=device) - ints["cu_seqlens"][request] + longs["context_lens"][request]
        slot_mapping = page_table[request, positions // page_size].long() * page_size + positions % page_size
        return cls(
            **longs, positions=positions, slot_mapping=slot_mapping, cu_seqlens=ints["cu_seqlens"],
            page_table=page_table, gdn_chunks=GdnChunks(ints["spans"].view(-1, 2), ints["first"]),
        )


@dataclass
class TokenRows:
    """Rows that each extend their slot's cached sequence by `tokens_per_row` consecutive tokens: one for a decode
    row, k + 1 for a speculative verify row (the last accepted token and k drafts). Attention takes each token as a
    row over its own prefix (its K/V are written first, so a token sees its row's earlier ones): the split-K
    decode kernel, which fills the GPU where a prefill's tiles of a few queries would not. A row of several tokens
    steps the GDN recurrence token by token from the state after the tokens its last verify step kept (`kept`),
    and keeps the state after each of its first T - 1 tokens for the next roll-back."""

    input_ids: torch.Tensor  # [R*T] long, row-major
    positions: torch.Tensor  # [R*T] long
    slots: torch.Tensor  # [R] long, -1 for padding rows
    page_table: torch.Tensor  # [R*T, P] int32: each token's row's pages
    seq_lens: torch.Tensor  # [R*T] long: each token's position + 1
    slot_mapping: torch.Tensor  # [R*T] long
    tokens_per_row: int = 1
    # [R] long, rows of several tokens only: tokens of each row's last verify step its GDN state keeps (1 .. T; T:
    # no roll-back), applied as the verify kernels read the state
    kept: torch.Tensor | None = None

    @classmethod
    def build(cls, token_rows: list[list[int]], starts: list[int], slots: list[int], pages: list[list[int]],
              page_size: int, trash_page: int, device, width: int | None = None,
              kept: list[int] | None = None) -> "TokenRows":
        """Row i: tokens `token_rows[i]` at positions starts[i].., state in slots[i], KV in pages[i]."""
        T = len(token_rows[0])
        width = width or max(len(p) for p in pages)
        ids, positions, mapping, table = [], [], [], []
        for tokens, start, row_pages in zip(token_rows, starts, pages):
            if len(tokens) != T:
                raise ValueError(f"every row needs {T} tokens, one has {len(tokens)}")
            if (start + T - 1) // page_size >= len(row_pages) or len(row_pages) > width:
                raise ValueError(f"a row at {start} needs pages for {T} tokens within the table width {width}; it "
                                 f"has {len(row_pages)}")
            ids.extend(tokens)
            positions.extend(range(start, start + T))
            mapping.extend(row_pages[p // page_size] * page_size + p % page_size for p in range(start, start + T))
            table.extend((row_pages + [trash_page] * (width - len(row_pages))) * T)
        several = {"kept": kept or [T] * len(token_rows)} if T > 1 else {}
        longs = upload({"input_ids": ids, "positions": positions, "slots": slots,
                        "seq_lens": [p + 1 for p in positions], "slot_mapping": mapping, **several}, torch.long, device)
        table_t = upload({"page_table": table}, torch.int32, device)["page_table"].view(-1, width)
        return cls(**longs, page_table=table_t, tokens_per_row=T)

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class StepBatch:
    """One forward's tokens: the rows' (`TokenRows`, row-major), then the prompt chunks' (`PromptChunks`); either
    part may be absent. Every projection reads the weights once for all of them; each mixer runs each part on its
    own kernels."""

    rows: TokenRows | None
    chunks: PromptChunks | None
    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    slot_mapping: torch.Tensor  # [N] long

    @classmethod
    def of(cls, rows: TokenRows | None = None, chunks: PromptChunks | None = None) -> "StepBatch":
        parts = [part for part in (rows, chunks) if part is not None]
        if not parts:
            raise ValueError("a step needs rows or prompt chunks")
        if len(parts) == 1:
            (part,) = parts
            return cls(rows, chunks, part.input_ids, part.positions, part.slot_mapping)
        return cls(rows, chunks, *(torch.cat([getattr(rows, f), getattr(chunks, f)])
                                   for f in ("input_ids", "positions", "slot_mapping")))

    @property
    def row_tokens(self) -> int:
        """Tokens of the rows: where the chunks' tokens start."""
        return 0 if self.rows is None else self.rows.tokens

    def chunk_ends(self) -> torch.Tensor:
        """Index of each chunk's last token in the step [R] (the chunks must be present)."""
        n = self.row_tokens
        return self.chunks.last_token + n if n else self.chunks.last_token


class PrefillInputs:
    """Fixed-address inputs of a prefill of up to `requests` chunks padded to a bucket of tokens, what a prefill
    CUDA graph reads: requests 0.. are the chunks, the next pads the bucket in the trash slot and page, and the rest
    (up to `requests` + 1) are empty there (the kernels skip an empty request). Each bucket's batch is a view of the
    same two buffers, so a graph captured over `batch(bucket)` reads what `fill` writes. With `head_trash` (the
    verify pools' trash row: a speculative engine) they also hold the MTP head's inputs: each token's following
    token, and the verify-pool row each request's last hidden state goes to."""

    def __init__(self, tokens: int, width: int, trash_slot: int, trash_page: int, page_size: int, device,
                 requests: int = 1, head_trash: int | None = None) -> None:
        self.tokens, self.width, self.page_size = tokens, width, page_size
        self.trash_slot, self.trash_page = trash_slot, trash_page
        self.requests, self.head_trash = requests, head_trash
        R = requests + 1
        # Each view's offset in its flat buffer (int64 or int32), the same for every bucket.
        self._views: dict[str, tuple[torch.dtype, int]] = {}
        sizes = {torch.long: 0, torch.int32: 0}
        for name, dtype, n in (("input_ids", torch.long, tokens), ("positions", torch.long, tokens),
                               ("slot_mapping", torch.long, tokens), ("slots", torch.long, R),
                               ("context_lens", torch.long, R), ("last_token", torch.long, R),
                               ("cu_seqlens", torch.int32, R + 1), ("page_table", torch.int32, R * width),
                               ("spans", torch.int32, 2 * self.chunks(tokens)), ("first", torch.int32, R + 1),
                               ("following", torch.long, tokens if head_trash is not None else 0),
                               ("head_rows", torch.long, R if head_trash is not None else 0)):
            self._views[name] = (dtype, sizes[dtype])
            sizes[dtype] += -(-n // ALIGN) * ALIGN
        self._flat = {dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
        self._no_fresh = torch.zeros(0, dtype=torch.long, device=device)
        self.fill_inert(tokens)

    def chunks(self, bucket: int) -> int:
        """GDN chunks of a padded batch: each request's ceil(L / 64) add up to at most this (a request boundary
        splits at most one chunk in two); the last request takes the rest as empty chunks."""
        return -(-bucket // GDN_CHUNK) + self.requests

    def _view(self, name: str, n: int) -> torch.Tensor:
        dtype, offset = self._views[name]
        return self._flat[dtype][offset : offset + n]

    def batch(self, bucket: int) -> PromptChunks:
        n, R = self.chunks(bucket), self.requests + 1
        return PromptChunks(
            input_ids=self._view("input_ids", bucket), positions=self._view("positions", bucket),
            cu_seqlens=self._view("cu_seqlens", R + 1), slots=self._view("slots", R),
            context_lens=self._view("context_lens", R),
            page_table=self._view("page_table", R * self.width).view(R, self.width),
            slot_mapping=self._view("slot_mapping", bucket), last_token=self._view("last_token", R),
            fresh_slots=self._no_fresh,
            gdn_chunks=GdnChunks(self._view("spans", 2 * n).view(n, 2), self._view("first", R + 1)),
        )

    def head_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(following token of each of `bucket` tokens, verify-pool row of each request's last hidden state)."""
        return self._view("following", bucket), self._view("head_rows", self.requests + 1)

    def fill_inert(self, bucket: int) -> None:
        """Inputs for `bucket` that touch only the trash slot and page (a program's runs before its capture). Each
        bucket's batch reads what only a fill for that bucket writes: the request bounds and GDN chunks."""
        head = ([0], [self.head_trash]) if self.head_trash is not None else (None, None)
        self.fill([PrefillChunk([0], 0, self.trash_slot, [self.trash_page])], bucket, *head)

    def fits(self, chunks: list[PrefillChunk], bucket: int) -> bool:
        return (0 < len(chunks) <= self.requests and all(c.token_ids and len(c.pages) <= self.width for c in chunks)
                and sum(len(c.token_ids) for c in chunks) <= bucket <= self.tokens)

    def fill(self, chunks: list[PrefillChunk], bucket: int, following: list[int] | None = None,
             head_rows: list[int] | None = None) -> None:
        """Write the chunks and the padding requests up to `bucket` (with the head's inputs: each chunk token's
        following token, each chunk's verify-pool row): one non-blocking copy per buffer, from pinned memory made
        for this fill (a buffer reused while its last copy is in flight would change under it)."""
        ps, R = self.page_size, self.requests + 1
        if not self.fits(chunks, bucket):
            raise ValueError(f"{len(chunks)} chunks of {sum(len(c.token_ids) for c in chunks)} tokens do not fit "
                             f"bucket {bucket} (at most {self.requests} chunks of at least one token and "
                             f"{self.width} pages, {self.tokens} tokens)")
        for c in chunks:
            c.check_pages(ps)
        # Built with array slices (C loops) rather than tensor ops: this runs before a prefill graph can launch,
        # and two dozen small tensor ops took longer than the arrays do.
        host = {dtype: array(_ARRAY_CODES[dtype], [0]) * flat.numel() for dtype, flat in self._flat.items()}

        def put(name: str, values) -> None:
            dtype, offset = self._views[name]
            values = array(_ARRAY_CODES[dtype], values)
            host[dtype][offset : offset + len(values)] = values

        cu, positions, mapping = [0], array("q"), array("q")
        for c in chunks:
            positions.extend(range(c.start, c.start + len(c.token_ids)))
            page_slots(mapping, c.pages, c.start, c.start + len(c.token_ids), ps)
            cu.append(cu[-1] + len(c.token_ids))
        padding = bucket - cu[-1]
        positions.extend(range(padding))
        if padding:  # every padding page is the trash page
            page_slots(mapping, [self.trash_page] * -(-padding // ps), 0, padding, ps)
        empty = R - len(chunks) - 1  # requests after the padding's, in the trash slot with no tokens
        put("input_ids", [t for c in chunks for t in c.token_ids])
        put("positions", positions)
        put("slot_mapping", mapping)
        put("slots", [c.slot for c in chunks] + [self.trash_slot] * (empty + 1))
        put("context_lens", [c.start for c in chunks] + [0] * (empty + 1))
        put("last_token", [e - 1 for e in cu[1:]] + [bucket - 1] * (empty + 1))  # padding rows: never read
        cu += [bucket] * (empty + 1)
        put("cu_seqlens", cu)
        table = array("i", [self.trash_page]) * (R * self.width)  # long contexts: wide rows
        for i, c in enumerate(chunks):
            table[i * self.width : i * self.width + len(c.pages)] = array("i", c.pages)
        put("page_table", table)
        spans, first = GdnChunks.layout(cu)
        spans += [bucket, bucket] * (self.chunks(bucket) - first[-1])
        first[-1] = self.chunks(bucket)
        if self.head_trash is not None:
            put("following", following)
            put("head_rows", list(head_rows) + [self.head_trash] * (R - len(head_rows)))
        put("spans", spans)
        put("first", first)
        for dtype, flat in self._flat.items():
            staged = torch.frombuffer(host[dtype], dtype=dtype)
            flat.copy_(staged.pin_memory() if flat.is_cuda else staged, non_blocking=True)
