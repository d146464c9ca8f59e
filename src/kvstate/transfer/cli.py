"""``kvstate transfer serve | generate | methods``: serving a cross-model state transfer, without the lab.

*Semantic Cache Distillation: Efficient State Transfer via Reuse and Selective Patching*
(``docs/techniques.md#across-models``) and its baselines, every one a registered method
(:mod:`kvstate.transfer.methods`): the producer serves one method's payloads over TCP, the consumer fetches,
decodes and generates. ``kvstate transfer methods`` lists the registry. The lab's ``kvstate transfer``
group (calibrate, bench, card) adds these commands as they are. torch / transformers load lazily.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kvstate.errors import KVStateError

console = Console()
DEFAULT_CODEC = Path("models/codec-ref-attn-ft2")  # the shifted pair's codec (models/ref-attn -> models/ref-attn-ft2)
METHOD_HELP = "A registered transfer method (`kvstate transfer methods` lists them); the consumer passes the same."
OPTION_HELP = ("KEY=VALUE option of the method, repeatable (e.g. droidspeak block=1:4, the bench's profiled block; "
               "scd patch=0,2); `kvstate transfer methods` lists each method's keys.")


def _threads(n: int) -> None:
    import torch

    from kvstate.validate import check_int

    torch.set_num_threads(check_int("--threads", n, 1, 256, error=KVStateError))


def positions(*dirs: Path) -> int | None:
    """The smallest ``max_position_embeddings`` of the models' configs (read before any weights)."""
    from kvstate.models.families import text_config
    from kvstate.models.loading import load_config

    limits = [getattr(text_config(load_config(d)), "max_position_embeddings", None) for d in dirs]
    known = [x for x in limits if isinstance(x, int)]
    return min(known) if known else None


def load_pair_model(model_dir: Path) -> tuple[Any, Any]:
    """(model, tokenizer) of a model directory: the library's loaders."""
    from kvstate.models.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(model_dir)  # the cheaper check first
    return load_model(model_dir), tokenizer


def method_context(method: str, codec_dir: Path, options: list[str] | None, block: str | None = None) -> Any:
    """The method's :class:`~kvstate.transfer.methods.MethodContext` from the command line, checked before any
    model loads (an unknown method lists the registry; an option it does not take names the method)."""
    from kvstate.transfer import methods as registry
    from kvstate.transfer.codec import Codec

    m = registry.get(method, shipped_only=True)
    opts = registry.parse_options(options)
    if block is not None:  # --block A:B: DroidSpeak's block, kept as a short form of --option block=A:B
        if "block" in opts:
            raise KVStateError("pass --block or --option block=..., not both")
        opts["block"] = block
    codec = Codec.load(codec_dir)
    ctx = registry.MethodContext(codec=codec, codec_dir=codec_dir, options=opts)
    try:
        m.check(ctx)
    except registry.MethodError as exc:
        raise registry.MethodError(str(exc).replace("--option block", "--block") if block is not None
                                   else str(exc)) from None
    return ctx


def serve_command(
    producer: Annotated[Path, typer.Option("--producer", help="Producer model directory.")],
    codec_dir: Annotated[Path, typer.Option("--codec", help="Codec directory (kvstate transfer calibrate).")] = DEFAULT_CODEC,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port (0: any free port).")] = 7070,
    store: Annotated[str, typer.Option("--store", help="Payload store: memory:// or redis://HOST:PORT/DB.")] = "memory://",
    threads: Annotated[int, typer.Option("--threads", help="torch CPU threads.")] = 1,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", help="Tokens per request at most (bounds how long one request holds the model).")] = 8192,
    method: Annotated[str, typer.Option("--method", help=METHOD_HELP)] = "scd",
    option: Annotated[list[str] | None, typer.Option("--option", help=OPTION_HELP)] = None,
    block: Annotated[str | None, typer.Option(
        "--block", help="Short for --option block=A:B (DroidSpeak's recomputed layers A..B-1).")] = None,
) -> None:
    """Serve one transfer method's payloads of prompt prefixes over TCP until interrupted."""
    import asyncio

    from kvstate.transfer import methods as registry
    from kvstate.transfer.serving import producer_service
    from kvstate.transfer.store import open_store
    from kvstate.transfer.transport import ServerConfig, start_server

    _threads(threads)
    config = ServerConfig(host=host, port=port, max_tokens=max_tokens)  # bad values fail before the model loads
    ctx = method_context(method, codec_dir, option, block)
    payloads = open_store(store)  # a bad or unreachable store is one line before the model loads
    model, _ = load_pair_model(producer)
    pair, encode = registry.encoder(method, model, ctx)
    service = producer_service(model, ctx.codec, payloads, encode, pair,
                               variant=registry.get(method).variant(ctx))

    async def main() -> None:
        server = await start_server(service, config)
        bound = server.sockets[0].getsockname()
        console.print(f"serving {method} payloads for pair {pair.hex()[:12]}… on {bound[0]}:{bound[1]} "
                      f"(store {store}); Ctrl-C stops")
        async with server:
            await server.serve_forever()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        console.print(f"stopped after {service.served} payloads ({service.hits} from the store; {service.corrupt} "
                      "corrupt stored payloads deleted and re-encoded)")


def generate_command(
    consumer: Annotated[Path, typer.Option("--consumer", help="Consumer model directory.")],
    server: Annotated[str, typer.Option("--server", help="Producer address HOST:PORT.")],
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt text (the producer prefills all but its last token).")],
    codec_dir: Annotated[Path, typer.Option("--codec", help="Codec directory.")] = DEFAULT_CODEC,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Tokens to generate.")] = 32,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds per network step.")] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    threads: Annotated[int, typer.Option("--threads", help="torch CPU threads.")] = 1,
    method: Annotated[str, typer.Option("--method", help="The producer's --method.")] = "scd",
    option: Annotated[list[str] | None, typer.Option("--option", help="The producer's --option values.")] = None,
    fallback: Annotated[bool, typer.Option("--fallback/--no-fallback", help="Prefill on the consumer when the "
                                           "producer is unreachable, its store failed or its payload is refused "
                                           "(corrupt, for other tokens, another method); said on stderr in one "
                                           "line.")] = True,
    gate: Annotated[bool, typer.Option("--gate/--no-gate", help="Check the decoded cache first: the consumer "
                                       "recomputes the last context tokens on it and compares its own K/V with the "
                                       "transferred; above --gate-max-error it prefills itself (a fallback). On by "
                                       "default: the configuration the real pair's bench measured.")] = True,
    gate_max_error: Annotated[float | None, typer.Option("--gate-max-error", help="The gate's largest accepted "
                                                         "mean relative K/V error (default: the measured one, "
                                                         "kvstate.transfer.gate.GateConfig).")] = None,
    gate_tokens: Annotated[int | None, typer.Option("--gate-tokens", help="Context tokens the gate recomputes "
                                                    "(default: GateConfig's).")] = None,
) -> None:
    """Fetch the prompt's payload from a producer, decode it into the consumer's cache and generate."""
    import json
    import sys
    from dataclasses import asdict

    from kvstate.transfer import methods as registry
    from kvstate.transfer.serving import consumer_generate
    from kvstate.transfer.transport import parse_address

    _threads(threads)
    parse_address(server)  # a malformed --server is one line before the model loads
    gate_config = None
    if gate:
        from kvstate.transfer.gate import GateConfig

        given = {k: v for k, v in (("tokens", gate_tokens), ("max_error", gate_max_error)) if v is not None}
        gate_config = GateConfig(**given)
    registry.get(method, shipped_only=True)
    limit = positions(consumer)
    if not 1 <= max_new_tokens <= (limit or 1 << 20):
        raise KVStateError(f"--max-new-tokens {max_new_tokens} must be in 1..{limit or 1 << 20:,} (the consumer's "
                           "positions)")
    ctx = method_context(method, codec_dir, option)
    model, tok = load_pair_model(consumer)
    gen = consumer_generate(model, tok, registry.receiver(method, model, ctx), server, prompt, max_new_tokens,
                            timeout, fallback=fallback, gate=gate_config)
    if gen.fallback is not None:  # one line, written directly: a Rich console would wrap it
        sys.stderr.write(f"no payload: {gen.fallback}\n")
        sys.stderr.flush()
    if as_json:
        sys.stdout.write(json.dumps(asdict(gen)) + "\n")
        sys.stdout.flush()
        return
    console.print(gen.text)
    if gen.fallback is not None:
        console.print(f"[dim]{gen.prompt_tokens} prompt tokens prefilled on the consumer, {gen.generate_ms:.1f} ms[/]")
        return
    console.print(f"[dim]{gen.prompt_tokens} prompt tokens, payload {gen.payload_bytes:,} B "
                  f"({'store' if gen.cached else 'encoded'}), wire {gen.wire_ms:.1f} ms, decode {gen.decode_ms:.1f} ms, "
                  f"generate {gen.generate_ms:.1f} ms[/]")


def methods_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON list.")] = False,
) -> None:
    """List the registered transfer methods: name, option keys, whether it ships a payload, what it is."""
    import json
    import sys

    from rich.table import Table

    from kvstate.transfer import methods as registry

    rows = registry.describe()
    if as_json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return
    table = Table(title="transfer methods (kvstate.transfer.methods)")
    for col in ("method", "options", "ships", "what"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["method"], ", ".join(r["options"]), "yes" if r["ships_payload"] else "no", r["summary"])
    console.print(table)


def register_commands(app: typer.Typer) -> None:
    """Add ``serve``, ``generate`` and ``methods`` to a ``transfer`` command group."""
    app.command("serve")(serve_command)
    app.command("generate")(generate_command)
    app.command("methods")(methods_command)
