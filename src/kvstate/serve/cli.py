"""``kvstate serve``: the command's options (registered by ``kvstate.cli``); the work is in :mod:`kvstate.serve.server`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

GRID_BLOCK = 256  # kvstate.prefix.grid.DEFAULT_BLOCK, written out so that the command's options load without it


def serve_command(
    model: Annotated[Path, typer.Option("--model", help="A local model directory with its tokenizer.")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
    budget_bytes: Annotated[int, typer.Option("--budget-bytes", min=1, help="Prefix cache byte budget.")] = 1 << 30,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Serve without the prefix cache (to compare).")] = False,
    max_queue: Annotated[int, typer.Option("--max-queue", min=1, help="Requests that may wait beyond the batch's "
                                           "free rows; more get 503.")] = 256,
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", min=1, help="Largest request body accepted; a "
                                                "larger one gets 413 before it is read.")] = 4 << 20,
    served_name: Annotated[str | None, typer.Option("--served-model-name",
                                                    help="Model name clients pass (default: the directory's name).")] = None,
    remote: Annotated[str | None, typer.Option("--remote", help="A shared prefix tier for replicas, "
                                               "redis://HOST:PORT/DB (KV and states written through, read on a miss).")] = None,
    remote_optional: Annotated[bool, typer.Option("--remote-optional", help="Start local-only, with a warning, when "
                                                  "--remote does not answer at startup (else exit 2).")] = False,
    remote_key_file: Annotated[Path | None, typer.Option("--remote-key-file", help="A file holding the cluster key "
                                                         "that signs the shared tier's entries (HMAC); default: "
                                                         "$KVSTATE_REMOTE_KEY, else the tier is trusted as is.")] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, max=1024, help="Requests decoded together "
                                           "(continuous batching).")] = 8,
    max_tokens_per_step: Annotated[int, typer.Option("--max-tokens-per-step", min=1, help="Prompt tokens a step "
                                                     "prefills (one forward call, beside one decode step of the "
                                                     "running batch).")] = 512,
    max_prefill_while_decoding: Annotated[int | None, typer.Option(
        "--max-prefill-while-decoding", min=1, help="Prompt tokens per step of a prefill that starts while other "
        "requests decode (Sarathi-Serve's stall-free budget: smaller keeps their inter-token latency down, larger "
        "gets the new request's first token sooner); default: --max-tokens-per-step.")] = None,
    max_preparing: Annotated[int, typer.Option("--max-preparing", min=1, max=1024, help="Requests tokenized at once "
                                               "(each holds up to its prompt's tokens); more wait, counted in "
                                               "--max-queue.")] = 2,
    shutdown_grace: Annotated[float, typer.Option("--shutdown-grace", min=0, max=86_400, help="Seconds the requests "
                                                  "running at SIGTERM may finish in (new ones get 503); then they "
                                                  "are ended with an error, and the server exits 0.")] = 30.0,
    grid_block: Annotated[int, typer.Option("--grid-block", min=0, help="Tokens between the recurrent-state "
                                            "checkpoints a prefill keeps on a grid (hybrid models), so a prefix's "
                                            "second sighting resumes at most one block before it diverges; 0: "
                                            "off.")] = GRID_BLOCK,
    grid_budget_share: Annotated[float, typer.Option("--grid-budget-share", min=0.0, max=1.0, help="The share "
                                                     "of --budget-bytes the grid checkpoints may hold (least "
                                                     "recently used ones go first).")] = 0.25,
    policy: Annotated[str, typer.Option("--policy", help="Admission order: fifo or longest-prefix (the request "
                                        "with the longest prefix-cache hit first).")] = "fifo",
) -> None:
    """An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics) with the sparse prefix
    cache under every request."""
    from kvstate.errors import KVStateError
    from kvstate.prefix.grid import GridConfig
    from kvstate.prefix.shared_tier import KEY_ENV, load_key
    from kvstate.serve.config import ServeConfig
    from kvstate.serve.policy import BatchPolicy
    from kvstate.serve.server import run

    if served_name is not None and not served_name.strip():
        raise KVStateError(f"--served-model-name {served_name!r} is empty; pass the name clients will send, or omit it "
                           "for the model directory's name")
    if remote_optional and remote is None:
        raise KVStateError("--remote-optional needs --remote redis://HOST:PORT/DB; pass both, or neither")
    config = ServeConfig(
        model_id=served_name or model.resolve().name,
        budget_bytes=None if no_cache else budget_bytes,
        max_queue=max_queue,
        remote=remote,
        max_body_bytes=max_body_bytes,
        remote_key_file=None if remote_key_file is None else str(remote_key_file),
        policy=BatchPolicy(policy, max_batch, max_tokens_per_step, max_prefill_while_decoding),
        max_preparing=max_preparing,
        shutdown_grace_s=shutdown_grace,
        grid=GridConfig(block=grid_block, budget_share=grid_budget_share),
    )
    if remote is not None:
        load_key(config.remote_key_file)  # a bad key file is one line before the model loads
        if remote_key_file is not None and os.environ.get(KEY_ENV) is not None:
            sys.stderr.write(f"warning: --remote-key-file and ${KEY_ENV} are both set; the file's key is used "
                             f"(unset ${KEY_ENV}, or drop --remote-key-file to use it)\n")
            sys.stderr.flush()
    run(model, config, host=host, port=port, remote_optional=remote_optional)
