"""The mesh's book of token budgets over a real gRPC channel: the control plane's ledger service
(xds/ledger.py) and the backend's client (inference/ledger.py), as `meshfn up` wires them
(bootstrap tokens of purpose "ledger", a backend proven as backend:<service>). Two backends of
one function spend one budget; a backend of another service, a wrong token or a malformed call
is refused; an unreachable ledger refuses the request with 503; the book survives a restart."""

from __future__ import annotations

import contextlib
import shutil
import socket
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest

from meshfn.contracts.function import TokenLedgerAccess
from meshfn.contracts.qos import (
    LIMIT_SERVICE_NODE_HEADER,
    TOKEN_LEDGER_PURPOSE,
    TOKEN_LEDGER_SERVICE,
    FunctionQoS,
    ledger_node,
)
from meshfn.contracts.token_book import Reservation, Shortfall
from meshfn.control_plane.identity.bootstrap_token import BootstrapTokens
from meshfn.inference.ledger import LedgerUnavailable, TokenLedger
from meshfn.inference.metrics import Metrics
from meshfn.inference.qos import Admission, Refusal
from meshfn.policy import load_policies
from meshfn.xds.ledger import Budgeted, TokenLedgerService, budgeted_functions

ROOT = Path(__file__).resolve().parents[2]
MODELS = ledger_node("default/models")
QOS = FunctionQoS.model_validate(
    {
        "policy": "default/llm-tokens",
        "defaultClass": "standard",
        "classes": [{"name": "standard", "tokens": [{"tokens": 500, "per": "month"}]}],
        "tenants": [{"name": "big", "tokens": [{"tokens": 5000, "per": "month"}]}],
    }
)
MID_MONTH = 1_800_000_000.0


class Ledger:
    """A ledger service on a loopback port and ways to reach it."""

    def __init__(self, tokens: BootstrapTokens, service: TokenLedgerService, port: int) -> None:
        self.tokens = tokens
        self.service = service
        self.port = port

    def access(self, node: str = MODELS, purpose: str = TOKEN_LEDGER_PURPOSE) -> TokenLedgerAccess:
        return TokenLedgerAccess(
            target=f"127.0.0.1:{self.port}",
            node=node,
            authorization=self.tokens.header(node, purpose),
        )

    def client(self, **kwargs: Any) -> TokenLedger:
        return TokenLedger(self.access(**kwargs), Metrics())


def _service(tmp: Path, tokens: BootstrapTokens) -> TokenLedgerService:
    functions = {"tiny-lm": Budgeted(QOS, MODELS)}
    return TokenLedgerService(
        lambda: functions,
        lambda node, header: tokens.verify(node, header, TOKEN_LEDGER_PURPOSE),
        state=tmp / "token-ledger.json",
        wall=lambda: MID_MONTH,
    )


@pytest.fixture
async def ledger(tmp_path: Path) -> AsyncIterator[Ledger]:
    tokens = BootstrapTokens(tmp_path / "xds-token.key")
    service = _service(tmp_path, tokens)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((service.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Ledger(tokens, service, port)
    finally:
        await server.stop(None)


def _admission(client: TokenLedger | None) -> Admission:
    return Admission("tiny-lm@1", QOS, 64, Metrics(), "tiny-lm", client)


async def test_two_backends_spend_one_budget(ledger: Ledger) -> None:
    a, b = _admission(ledger.client()), _admission(ledger.client())
    ticket = a.admit("acme")
    held = await a.reserve(ticket, 20, 200)  # 220 of 500 held
    assert held is not None and dict(held.headers)[b"x-ratelimit-remaining-tokens"] == b"280"
    other = await b.reserve(b.admit("acme"), 20, 200)  # the other backend sees the hold
    assert other is not None and dict(other.headers)[b"x-ratelimit-remaining-tokens"] == b"60"
    with pytest.raises(Refusal) as caught:
        await b.reserve(b.admit("acme"), 20, 200)
    assert caught.value.status == 429 and caught.value.payload["tokens_left"] == 60
    settled: list[Mapping[str, int]] = []
    assert a.ledger is not None
    a.ledger.settle("tiny-lm", "acme", held.reservation, 50, settled.append)
    await a.ledger.close()
    assert settled == [{"month": 50}]  # the hold of 220 became 50 used
    again = await b.reserve(b.admit("acme"), 20, 200)
    assert again is not None and dict(again.headers)[b"x-ratelimit-remaining-tokens"] == b"10"
    # a tenant of its own: its own budget, in the same book
    big = await b.reserve(b.admit("big"), 20, 200)
    assert big is not None and dict(big.headers)[b"x-ratelimit-remaining-tokens"] == b"4780"


async def test_callers_must_prove_themselves_and_serve_the_function(ledger: Ledger) -> None:
    wrong_purpose = ledger.client(purpose="rls")  # a limit-service token is not a ledger token
    with pytest.raises(LedgerUnavailable) as caught:
        await wrong_purpose.reserve("tiny-lm", "acme", 1, 1)
    assert caught.value.status == 503 and "unauthenticated" in caught.value.message
    elsewhere = ledger.client(node=ledger_node("default/other"))  # proven, but not tiny-lm's
    with pytest.raises(LedgerUnavailable, match="permission_denied"):
        await elsewhere.reserve("tiny-lm", "acme", 1, 1)
    with pytest.raises(LedgerUnavailable, match="not_found"):
        await ledger.client().reserve("no-such-fn", "acme", 1, 1)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{ledger.port}")
    metadata = ((LIMIT_SERVICE_NODE_HEADER, MODELS),
                ("authorization", ledger.tokens.header(MODELS, TOKEN_LEDGER_PURPOSE)))  # fmt: skip
    call = channel.unary_unary(f"/{TOKEN_LEDGER_SERVICE}/Reserve")
    for body in (b"{not json", b"[]", b'{"function": "tiny-lm", "tenant": "a", "prompt": -1, '
                 b'"max_tokens": 1}', b"x" * 5000):  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await call(body, metadata=metadata)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await channel.close()
    assert ledger.service.book.rows() == []  # nothing was booked by any of them


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A loopback port that refuses connections while the block runs (bound, not listening)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


async def test_an_unreachable_ledger_refuses_with_503() -> None:
    with closed_port() as port:
        access = TokenLedgerAccess(target=f"127.0.0.1:{port}", node=MODELS, authorization="x")
        admission = _admission(TokenLedger(access, Metrics()))
        with pytest.raises(LedgerUnavailable) as caught:
            await admission.reserve(admission.admit("acme"), 1, 1)
    assert caught.value.status == 503 and dict(caught.value.headers)[b"retry-after"] == b"1"


async def test_the_book_survives_a_restart(ledger: Ledger, tmp_path: Path) -> None:
    client = ledger.client()
    held = await client.reserve("tiny-lm", "acme", 10, 100)
    assert isinstance(held, Reservation)
    client.settle("tiny-lm", "acme", held, 110, lambda _: None)
    await client.close()
    ledger.service.flush()
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(tmp_path / "token-ledger.json", copy / "token-ledger.json")
    restarted = _service(copy, ledger.tokens)
    short = restarted.reserve(MODELS, {"function": "tiny-lm", "tenant": "acme", "prompt": 1,
                                       "max_tokens": 390})  # fmt: skip
    assert Shortfall.from_json(short["shortfall"]).left == 390  # 500 - 110 used before


def test_the_functions_with_token_budgets_come_from_the_policies(tmp_path: Path) -> None:
    policies = tmp_path / "policies"
    shutil.copytree(ROOT / "policies" / "examples", policies)
    (policies / "zz-tokens.yaml").write_text(
        "apiVersion: meshfn.io/v1alpha1\nkind: QoSPolicy\n"
        "metadata: {name: llm-tokens, namespace: default}\n"
        "spec:\n  targetRefs: [{kind: Function, name: tiny-lm}]\n  defaultClass: standard\n"
        "  classes: [{name: standard, tokens: [{tokens: 700, per: month}]}]\n"
        "---\napiVersion: meshfn.io/v1alpha1\nkind: RequestAuthentication\n"
        "metadata: {name: edge-tokens, namespace: ingress}\n"
        "spec:\n  jwtRules: [{issuer: https://issuer.meshfn.local, audiences: [meshfn],\n"
        "    jwksUri: http://127.0.0.1:18001/.well-known/jwks.json}]\n"
    )
    found = budgeted_functions(load_policies(policies))
    assert list(found) == ["tiny-lm"] and found["tiny-lm"].caller == MODELS
