"""xgrammar against llguidance on one tokenizer and a set of JSON schemas: compile time, the host's time to fill a
token mask, and whether what the mask lets through is valid (random logits stand in for a random-weight model at
temperature 1, the hardest case: every allowed token is as likely as any other).

    python -m deltaserve.tools.lab.grammar_engines CHECKPOINT_DIR [--schemas FILE] [--walks 10] [--tokens 600]

Prints a row per engine: median compile ms, mean and p99 mask-fill microseconds a token, outputs that ended, and
those that ended and do not parse or do not validate (jsonschema).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jsonschema
import torch

from deltaserve.runtime.text import TextTokenizer

FLEXIBLE = True  # whitespace: any between JSON tokens, or the compact separators (--compact)
SCHEMAS = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "json_schemas.json")


def vocabulary(tok: TextTokenizer, vocab: int) -> tuple[list[bytes], set[int]]:
    special = {i for i, t in tok.tok.get_added_tokens_decoder().items() if t.special}
    n = min(tok.tok.get_vocab_size(with_added_tokens=True), vocab)
    return [b"" if i in special else tok.token_bytes(i) for i in range(n)] + [b""] * (vocab - n), special


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab, stop):
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        tokens, _ = vocabulary(tok, vocab)
        self.compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=vocab,
                                                              stop_token_ids=[stop]))

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=FLEXIBLE)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, mask):
        m.fill_next_token_bitmask(mask, 0)

    def accept(self, m, token):
        return m.accept_token(token)

    def done(self, m):
        return m.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab, stop):
        import llguidance
        import llguidance.torch

        self.llg, self.vocab = llguidance, vocab
        tokens, special = vocabulary(tok, vocab)

        class Vocabulary:  # what llguidance's TokenizerWrapper reads
            eos_token_id, bos_token_id = stop, None
            special_token_ids = sorted(special | {i for i, t in enumerate(tokens) if not t})

            def __init__(self):
                # llguidance marks a special token by a leading 0xff byte; an empty entry would be a text token
                self.tokens = [t if t else b"\xff<unused" + str(i).encode() + b">" for i, t in enumerate(tokens)]

            def __call__(self, text):
                text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
                return tok.encode(text)

        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()), n_vocab=vocab)
        self.fill_mask = llguidance.torch.fill_next_token_bitmask

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": FLEXIBLE})
        message = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if message:
            raise ValueError(message)
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def fill(self, m, mask):
        self.fill_mask(m, mask, 0)

    def accept(self, m, token):
        return m.consume_token(token)

    def done(self, m):
        return m.is_stopped()


def walk(engine, compiled, tok, stop, tokens, seed):
    """A random walk under the mask: (the text if it ended, else None; the seconds of each mask fill)."""
    g = torch.Generator().manual_seed(seed)
    m = engine.matcher(compiled)
    mask = torch.empty(1, (engine.vocab + 31) // 32, dtype=torch.int32)
    ids = torch.arange(engine.vocab)
    out, fills = [], []
    for _ in range(tokens):
        began = time.perf_counter()
        engine.fill(m, mask)
        fills.append(time.perf_counter() - began)
        allowed = (mask[0, ids >> 5] >> (ids & 31)) & 1
        logits = torch.randn(engine.vocab, generator=g).masked_fill(allowed == 0, float("-inf"))
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=g))
        if not engine.accept(m, token):
            raise RuntimeError(f"{engine.name} refused token {token}, which its own mask allowed")
        if token == stop:
            return tok.decode(out), fills
        out.append(token)
        if engine.done(m):
            return tok.decode(out), fills
    return None, fills


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--schemas", default=SCHEMAS)
    p.add_argument("--walks", type=int, default=10, help="random outputs a schema")
    p.add_argument("--tokens", type=int, default=600, help="the most tokens a walk takes")
    p.add_argument("--engines", default="xgrammar,llguidance")
    p.add_argument("--compact", action="store_true", help="no whitespace beyond the separators' own")
    args = p.parse_args(argv)
    global FLEXIBLE
    FLEXIBLE = not args.compact
    tok = TextTokenizer(args.checkpoint)
    with open(os.path.join(args.checkpoint, "config.json")) as f:
        config = json.load(f)
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    stop = tok.tok.token_to_id("<|im_end|>")
    with open(args.schemas) as f:
        schemas = json.load(f)
    print(f"vocabulary {vocab} ({tok.vocab_size} in the tokenizer), {len(schemas)} schemas, {args.walks} walks each, "
          f"whitespace {'flexible' if FLEXIBLE else 'compact'}")
    print("| engine | set-up s | compile ms (median) | mask fill us (mean / p99) | ended | invalid | failures |")
    print("|---|---|---|---|---|---|---|")
    for name in args.engines.split(","):
        began = time.perf_counter()
        engine = {"xgrammar": XGrammar, "llguidance": LLGuidance}[name](tok, vocab, stop)
        setup = time.perf_counter() - began
        compiles, fills, ended, invalid, failures = [], [], 0, [], []
        for i, schema in enumerate(schemas):
            began = time.perf_counter()
            try:
                compiled = engine.compile(schema)
            except Exception as exc:  # noqa: BLE001 (a lab tool: report and go on)
                failures.append(f"schema {i}: {str(exc)[:80]}")
                continue
            compiles.append(time.perf_counter() - began)
            for w in range(args.walks):
                try:
                    text, walk_fills = walk(engine, compiled, tok, stop, args.tokens, seed=1000 * i + w)
                except RuntimeError as exc:
                    failures.append(f"schema {i}: {exc}")
                    continue
                fills += walk_fills
                if text is None:
                    continue
                ended += 1
                try:
                    jsonschema.validate(json.loads(text), schema)
                except (ValueError, jsonschema.ValidationError) as exc:
                    invalid.append(f"schema {i}: {str(exc).splitlines()[0][:80]}: {text[:60]!r}")
        fills.sort()
        if not compiles:
            print(f"| {name} | {setup:.2f} | - | - | 0 | 0 | {len(failures)} |")
            for line in failures[:4]:
                print(f"    {name}: {line}")
            continue
        print(f"| {name} | {setup:.2f} | {1e3 * statistics.median(compiles):.1f} | "
              f"{1e6 * statistics.mean(fills):.0f} / {1e6 * fills[int(0.99 * (len(fills) - 1))]:.0f} | "
              f"{ended} / {len(schemas) * args.walks} | {len(invalid)} | {len(failures)} |")
        for line in (invalid + failures)[:8]:
            print(f"    {name}: {line}")


if __name__ == "__main__":
    main()
