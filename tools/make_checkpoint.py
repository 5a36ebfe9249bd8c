"""Write a random Qwen3.5 checkpoint in the real Hugging Face layout, with a small trained tokenizer
(deltaserve.model.synthetic).

    python -m deltaserve.tools.make_checkpoint OUT_DIR [--size tiny|0.8b|4b|9b|27b|tiny-moe|35b-a3b|122b-a10b|
        397b-a17b|...] [--layers N] [--dtype float32|bfloat16] [--sharded N] [--layout wrapper|plain]
        [--tied|--untied] [--seed S] [--config-only] [--no-mtp] [--fp8] [--experts split|fused]

The checkpoint holds the multi-token-prediction head (`mtp.*`, random like the rest) unless --no-mtp. --fp8 stores
the projections in Qwen's block-scaled FP8 format (float8_e4m3fn values, a float32 weight_scale_inv per 128 x 128
block, quantization_config quant_method "fp8"). The MoE sizes store a tensor per expert and projection, as the
published checkpoints do, or with --experts fused each layer's experts as two 3-D tensors (as some converters do).
"""

from __future__ import annotations

import argparse
import logging

from deltaserve.model.synthetic import SIZES, write_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--sharded", type=int, default=1, help="number of safetensors files (with an index)")
    parser.add_argument("--layout", default="wrapper", choices=["wrapper", "plain"])
    parser.add_argument("--tied", dest="tied", action="store_true", default=None, help="tie lm_head to the embedding")
    parser.add_argument("--untied", dest="tied", action="store_false", help="store a separate lm_head")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config-only", action="store_true",
                        help="write config and tokenizer but no weights (serve with load_format='random')")
    parser.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=True,
                        help="write the multi-token-prediction head's tensors (mtp.*), as Qwen3.5 checkpoints ship it")
    parser.add_argument("--fp8", action="store_true", help="projections in the block-scaled FP8 format")
    parser.add_argument("--experts", default="split", choices=["split", "fused"],
                        help="MoE sizes: a tensor per expert and projection, or each layer's experts as 3-D tensors")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    write_checkpoint(args.out_dir, args.size, layers=args.layers, dtype=args.dtype, sharded=args.sharded,
                     layout=args.layout, tied=args.tied, seed=args.seed, weights=not args.config_only,
                     mtp=args.mtp, fp8=args.fp8, experts=args.experts)


if __name__ == "__main__":
    main()
