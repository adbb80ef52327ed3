"""``duet pull MODEL``: fetch a model from the Hugging Face hub into its cache, with progress."""

from __future__ import annotations


def add_pull_parser(sub) -> None:
    p = sub.add_parser(
        "pull",
        help="download a model from the Hugging Face hub (owner/repo[:QUANT])",
        description=(
            "Download a model into the Hugging Face cache: owner/repo (an MLX/safetensors or a GGUF repo), "
            "owner/repo:QUANT or hf.co/owner/repo:QUANT (a GGUF repo's file of that quant, e.g. Q4_K_M; "
            "without one Q4_K_M, else Q4_0, else the smallest). An interrupted pull resumes where it "
            "stopped. HF_TOKEN, HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE apply."
        ),
    )
    p.add_argument(
        "model", help="owner/repo, owner/repo:QUANT, hf.co/owner/repo:QUANT or a huggingface.co URL"
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bars; print only the path")
    p.set_defaults(func=cmd_pull)


def cmd_pull(args) -> int:
    from mlx_engine.loading.pull import pull, terminal_progress

    pulled = pull(args.model, progress=None if args.quiet else terminal_progress())
    if not args.quiet:
        how = f"{pulled.downloaded / 1e6:.1f} MB downloaded" if pulled.downloaded else "already in the cache"
        print(f"{pulled.name}: {how}")
    print(pulled.path)
    return 0
