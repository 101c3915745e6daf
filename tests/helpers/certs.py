"""Certificates for the TLS tests, made with `cryptography` (EC P-256, valid for a day): a CA, leaves it
signs, PEM files. Shared by test modules (test_tls.py, test_tls_identity.py, test_tls_per_stage.py, ...).

    ca = make_ca("specpipe-ca")
    ca_file = write_ca(tmp, "ca", ca)
    cert, key = write(tmp, "stage-1", *make_leaf(ca, "specpipe-stage-1"))
"""
from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path


def make_ca(name: str):
    """A self-signed CA: (private key, certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_leaf(ca, name: str, dns_names: Sequence[str] = ("localhost",), ips: Sequence[str] = ("127.0.0.1",),
              client_only: bool = False):
    """A certificate `ca` signs: common name `name`, these SANs, server and client auth (`client_only`: client
    auth alone). Returns (private key, certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client_only else [ExtendedKeyUsageOID.SERVER_AUTH,
                                                                     ExtendedKeyUsageOID.CLIENT_AUTH]
    sans = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def write(tmp: Path, name: str, key, cert) -> tuple[str, str]:
    """`name`.crt and `name`.key (PKCS#8) in `tmp`: their paths (certificate, key)."""
    from cryptography.hazmat.primitives import serialization
    (tmp / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    (tmp / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(tmp / f"{name}.crt"), str(tmp / f"{name}.key")


def write_ca(tmp: Path, name: str, ca) -> str:
    """The CA's certificate alone (what peers trust) as `name`.crt in `tmp`: its path."""
    from cryptography.hazmat.primitives import serialization
    (tmp / f"{name}.crt").write_bytes(ca[1].public_bytes(serialization.Encoding.PEM))
    return str(tmp / f"{name}.crt")
