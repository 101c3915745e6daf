"""TLS for every hop, from certificate files (PEM), peer identities, and a bearer token for the public API.

Internal hops (coordinator -> stages, stage -> next stage) use mutual TLS: each service presents its
certificate (`cert`, `key`) and trusts peers signed by `ca`; a stage refuses clients without a valid
certificate from it, and refuses to start with a certificate but no CA (it could not authenticate anyone).
Without files every hop is plaintext (local development).

Identities: the names in a peer's certificate (its common name and subject alternative names). A stage
accepts Configure, Results and Control only from the coordinator's name, Forward from the coordinator or a
stage's name (`PeerNames`); Info and health from any peer with a certificate from the CA. With a certificate
per stage and a name template (`PeerNames.predecessor`), stage i accepts Forward only from stage i-1's name,
stage 0 only from the coordinator.

    tls = TLSFiles("/tls/tls.crt", "/tls/tls.key", "/tls/ca.crt")
    server.bind("0.0.0.0", 50061, tls.mutual_server_credentials())
    channel = open_channel("stage-1:50061", tls, options)
    await require_peer(context, "Configure", PeerNames())      # in a handler: PERMISSION_DENIED for others
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import grpc

COORDINATOR_NAME = "specpipe-coordinator"     # the coordinator's identity by default
STAGE_NAME = "specpipe-stage"                 # the stages' identity by default


@dataclass(frozen=True)
class TLSFiles:
    cert: str = ""          # PEM certificate chain of this service
    key: str = ""           # its private key
    ca: str = ""            # CA bundle that peers' certificates must chain to

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("TLS needs both a certificate and its key (or neither)")
        for name in (self.cert, self.key, self.ca):
            if name and not Path(name).is_file():
                raise ValueError(f"TLS file {name} does not exist")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def _read(self, name: str) -> bytes | None:
        return Path(name).read_bytes() if name else None

    def require_mutual(self, who: str = "a stage") -> "TLSFiles":
        """Raise unless this is plaintext or full mutual TLS: a certificate without a CA would skip client
        authentication, a CA without a certificate would serve plaintext."""
        if self.enabled and not self.ca:
            raise ValueError(f"{who} with a TLS certificate needs the CA its peers' certificates chain to "
                             "(--tls-ca / SPECPIPE_TLS_CA): without it clients could not be authenticated")
        if self.ca and not self.enabled:
            raise ValueError(f"{who} with a TLS CA needs its own certificate and key (--tls-cert, --tls-key): "
                             "without them it would serve plaintext")
        return self

    def mutual_server_credentials(self) -> grpc.ServerCredentials | None:
        """A stage's server side: None for plaintext, else TLS requiring a client certificate from `ca`;
        raises for a certificate without a CA (see `require_mutual`)."""
        return self.require_mutual().server_credentials()

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None without a certificate (plaintext). With a CA, clients must present a certificate it signed;
        without one this is server-only TLS (the public API; stages use `mutual_server_credentials`)."""
        if not self.enabled:
            return None
        return grpc.ssl_server_credentials([(self._read(self.key), self._read(self.cert))],
                                           root_certificates=self._read(self.ca),
                                           require_client_auth=bool(self.ca))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: trust `ca` (system roots without it) and present our certificate if we have one."""
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca),
                                            private_key=self._read(self.key),
                                            certificate_chain=self._read(self.cert))


def open_channel(address: str, tls: TLSFiles | None, options: list | None = None) -> grpc.aio.Channel:
    """A channel to a service: TLS when we have a CA or a certificate, plaintext otherwise."""
    if tls is not None and (tls.enabled or tls.ca):
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


@dataclass(frozen=True)
class PeerNames:
    """Which certificate names may call which Stage RPC: Configure, Results and Control only `coordinator`;
    Forward `coordinator` or one of `peers` (the stages); any other RPC every authenticated peer.

    With `predecessor`, a template of the stages' names in which "{index}" stands for a stage's index (one
    certificate per stage), Forward comes from the stage before this one (`stage`) alone, and on stage 0
    from the coordinator alone; `peers` are then unused.

    >>> sorted(PeerNames().allowed("Forward"))
    ['specpipe-coordinator', 'specpipe-stage']
    >>> sorted(PeerNames(predecessor="specpipe-stage-{index}", stage=2).allowed("Forward"))
    ['specpipe-stage-1']
    >>> sorted(PeerNames(predecessor="specpipe-stage-{index}", stage=0).allowed("Forward"))
    ['specpipe-coordinator']
    """

    coordinator: str = COORDINATOR_NAME
    peers: tuple[str, ...] = (STAGE_NAME,)
    predecessor: str = ""       # e.g. "specpipe-stage-{index}"; empty: any of `peers` may forward
    stage: int = 0              # this stage's index: whose name `predecessor` gives

    COORDINATOR_ONLY: ClassVar[frozenset[str]] = frozenset({"Configure", "Results", "Control"})
    INDEX: ClassVar[str] = "{index}"

    def __post_init__(self) -> None:
        for name in (self.coordinator, *self.peers):
            _check_name(name)
        if self.stage < 0:
            raise ValueError(f"stage {self.stage} is not an index (0 or more)")
        if not self.predecessor:
            return
        prefix, _, suffix = self.predecessor.partition(self.INDEX)
        if self.INDEX not in self.predecessor or any(c in prefix + suffix for c in "{}"):
            raise ValueError(f"TLS peer template {self.predecessor!r} needs {self.INDEX} exactly once and no other "
                             "braces, e.g. specpipe-stage-{index}")
        _check_name(prefix + "0" + suffix)
        if re.fullmatch(re.escape(prefix) + "[0-9]+" + re.escape(suffix), self.coordinator):
            raise ValueError(f"the coordinator's name {self.coordinator!r} is a stage's name by the TLS peer template "
                             f"{self.predecessor!r}: that stage could reconfigure every other")

    @classmethod
    def parse(cls, coordinator: str, peers: str | Iterable[str], predecessor: str = "",
              stage: int = 0) -> "PeerNames":
        """From flags: `peers` may be comma-separated ("a,b")."""
        items = peers.split(",") if isinstance(peers, str) else peers
        return cls(coordinator.strip(), tuple(p.strip() for p in items if p.strip()), predecessor.strip(), stage)

    def stage_name(self, index: int) -> str:
        """The certificate name of stage `index` by the template (`predecessor`)."""
        return self.predecessor.replace(self.INDEX, str(index))

    def allowed(self, rpc: str) -> frozenset[str] | None:
        """The names that may call `rpc`; None: any peer the TLS handshake admitted."""
        if rpc in self.COORDINATOR_ONLY:
            return frozenset({self.coordinator})
        if rpc == "Forward":
            if not self.predecessor:
                return frozenset({self.coordinator, *self.peers})
            return frozenset({self.stage_name(self.stage - 1) if self.stage else self.coordinator})
        return None


def _check_name(name: str) -> None:
    if not name or "," in name or any(c.isspace() for c in name):
        raise ValueError(f"TLS identity {name!r} is not a certificate name (non-empty, no spaces or commas)")


def peer_names(context: grpc.aio.ServicerContext) -> list[str]:
    """The names a TLS peer's certificate carries: its common name, then its subject alternative names."""
    auth = context.auth_context() or {}
    names: list[str] = []
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for value in auth.get(key, ()):
            name = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            if name not in names:
                names.append(name)
    return names


async def require_peer(context: grpc.aio.ServicerContext, rpc: str, policy: PeerNames | None) -> None:
    """Abort the call with PERMISSION_DENIED unless the peer's certificate names someone `policy` lets call
    `rpc` (no check without a policy: TLS off)."""
    if policy is None:
        return
    allowed = policy.allowed(rpc)
    if allowed is None:
        return
    seen = peer_names(context)
    if allowed.intersection(seen):
        return
    await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                        f"{rpc} is accepted only from {' or '.join(sorted(allowed))}; the peer's certificate "
                        f"names {', '.join(seen) if seen else 'no one'} (peer {context.peer()})")
