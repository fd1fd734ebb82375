"""A local Google Cloud Storage for tests: gcp-storage-emulator behind a TLS proxy.

TensorFlow's GCS filesystem talks to hard-coded https endpoints
(www.googleapis.com, storage.googleapis.com) and has no endpoint setting, but
its libcurl honours HTTPS_PROXY and CURL_CA_BUNDLE, and
GOOGLE_AUTH_TOKEN_FOR_TESTING skips authentication. So `LocalGCS` runs, each as
a subprocess (in-process, the emulator deadlocks checkpoint restores):

* gcp-storage-emulator on 127.0.0.1 (plain HTTP, in memory);
* this file's proxy: it accepts CONNECT, terminates TLS with a certificate for
  the Google hosts signed by a throwaway CA, de-chunks request bodies (TF
  uploads with chunked transfer encoding), forwards each request to the
  emulator, and turns the emulator's http:// upload URLs back into https://.

`google-cloud-storage` reaches the emulator directly through STORAGE_EMULATOR_HOST.
Run as a script, this file is the proxy: `python gcs_emulator.py PORT_FILE UPSTREAM CERT KEY`.
"""

from __future__ import annotations

import datetime
import http.client
import json
import os
import socket
import socketserver
import ssl
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

GOOGLE_HOSTS = ("www.googleapis.com", "storage.googleapis.com", "oauth2.googleapis.com")
BUCKET = "tputrain-test"
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization",
               "transfer-encoding", "te", "trailer", "upgrade", "content-length"}


# ---------------------------------------------------------------- certificates


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a leaf certificate for the Google hosts: (ca, cert, key) PEMs."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    valid = dict(not_valid_before=now - datetime.timedelta(days=1),
                 not_valid_after=now + datetime.timedelta(days=7))

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("tputrain test CA"))
          .issuer_name(name("tputrain test CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(name(GOOGLE_HOSTS[0]))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(valid["not_valid_before"])
            .not_valid_after(valid["not_valid_after"])
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName(h) for h in (*GOOGLE_HOSTS, "*.googleapis.com")]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


# ----------------------------------------------------------------------- proxy


def _read_head(stream) -> tuple[str, list[tuple[str, str]]] | None:
    line = stream.readline(65537)
    if not line:
        return None
    request_line = line.decode("latin-1").rstrip("\r\n")
    headers = []
    while True:
        line = stream.readline(65537).decode("latin-1").rstrip("\r\n")
        if not line:
            return request_line, headers
        key, _, value = line.partition(":")
        headers.append((key.strip(), value.strip()))


def _read_body(stream, headers: list[tuple[str, str]]) -> bytes:
    values = {k.lower(): v for k, v in headers}
    if values.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size = int(stream.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while stream.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return body
            body += stream.read(size)
            stream.readline()
    length = int(values.get("content-length", "0") or 0)
    return stream.read(length) if length else b""


def _empty_media_as_multipart(path: str, headers: dict[str, str]):
    """gcp-storage-emulator crashes on an empty `uploadType=media` upload (TF writes
    those as directory markers); the same object as a multipart upload works."""
    url = urllib.parse.urlsplit(path)
    query = urllib.parse.parse_qs(url.query)
    name = query.pop("name")[0]
    query["uploadType"] = ["multipart"]
    boundary = "tputrain-empty-object"
    body = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
            f"{json.dumps({'name': name})}\r\n--{boundary}\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n\r\n--{boundary}--\r\n").encode()
    headers = dict(headers, **{"Content-Type": f"multipart/related; boundary={boundary}"})
    return (f"{url.path}?{urllib.parse.urlencode(query, doseq=True)}", body, headers)


class _Tunnel(socketserver.StreamRequestHandler):
    """One client connection: CONNECT, TLS, then HTTP requests relayed to the emulator."""

    def handle(self) -> None:
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = _read_head(self.rfile)
        if head is None or not head[0].upper().startswith("CONNECT "):
            self.wfile.write(b"HTTP/1.1 405 Only CONNECT\r\nContent-Length: 0\r\n\r\n")
            return
        self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        self.wfile.flush()
        tls = self.server.tls.wrap_socket(self.connection, server_side=True)
        stream = tls.makefile("rb")
        upstream = http.client.HTTPConnection(*self.server.upstream, timeout=120)
        try:
            while True:
                head = _read_head(stream)
                if head is None:
                    return
                method, path, _ = head[0].split(" ", 2)
                if any(k.lower() == "expect" and v.lower() == "100-continue" for k, v in head[1]):
                    # Else curl waits a second for this before sending the body.
                    tls.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = _read_body(stream, head[1])
                if os.environ.get("GCS_PROXY_DEBUG"):
                    print(f"proxy: {method} {path} {len(body)} bytes {head[1]}", file=sys.stderr,
                          flush=True)
                headers = {k: v for k, v in head[1]
                           if k.lower() not in _HOP_BY_HOP and k.lower() != "expect"}
                if method == "POST" and not body and "uploadType=media" in path:
                    path, body, headers = _empty_media_as_multipart(path, headers)
                if method in ("POST", "PUT", "PATCH"):
                    headers["Content-Length"] = str(len(body))
                upstream.request(method, path, body=body or None, headers=headers)
                if upstream.sock is not None:
                    upstream.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                response = upstream.getresponse()
                data = response.read()
                lines = [f"HTTP/1.1 {response.status} {response.reason}"]
                for key, value in response.getheaders():
                    if key.lower() in _HOP_BY_HOP:
                        continue
                    if key.lower() == "location" and value.startswith("http://"):
                        value = "https://" + value[len("http://"):]
                    lines.append(f"{key}: {value}")
                lines.append(f"Content-Length: {0 if method == 'HEAD' else len(data)}")
                tls.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
                            + (b"" if method == "HEAD" else data))
        except (ConnectionError, ssl.SSLError, OSError, http.client.HTTPException) as error:
            if os.environ.get("GCS_PROXY_DEBUG"):
                print(f"proxy: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            return
        finally:
            upstream.close()


class _ProxyServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve_proxy(port_file: str, upstream: str, cert: str, key: str) -> None:
    host, _, port = upstream.rpartition(":")
    server = _ProxyServer(("127.0.0.1", 0), _Tunnel)
    server.upstream = (host, int(port))
    server.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.tls.load_cert_chain(cert, key)
    Path(port_file).write_text(str(server.server_address[1]))
    server.serve_forever()


# --------------------------------------------------------------------- fixture


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(predicate, timeout: float, what: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not start within {timeout} s")


class LocalGCS:
    """Emulator + TLS proxy subprocesses; `env` points TF and google-cloud-storage at them."""

    def __init__(self, directory: Path, bucket: str = BUCKET):
        self.directory = Path(directory)
        self.bucket = bucket
        self._processes: list[subprocess.Popen] = []
        self.env: dict[str, str] = {}

    def start(self) -> "LocalGCS":
        ca, cert, key = make_certificates(self.directory)
        port = _free_port()
        emulator = subprocess.Popen(
            [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
             "--port", str(port), "--in-memory", "--default-bucket", self.bucket, "--quiet"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._processes.append(emulator)
        _wait(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).status == 200,
              30, "gcp-storage-emulator", emulator)
        port_file = self.directory / "proxy.port"
        proxy = subprocess.Popen([sys.executable, __file__, str(port_file), f"127.0.0.1:{port}",
                                  str(cert), str(key)])
        self._processes.append(proxy)
        _wait(lambda: port_file.exists() and port_file.read_text(), 30, "TLS proxy", proxy)
        proxy_url = f"http://127.0.0.1:{port_file.read_text()}"
        self.env = {
            "HTTPS_PROXY": proxy_url, "https_proxy": proxy_url, "NO_PROXY": "", "no_proxy": "",
            "CURL_CA_BUNDLE": str(ca), "GOOGLE_AUTH_TOKEN_FOR_TESTING": "tputrain-test",
            "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
        }
        return self

    def stop(self) -> None:
        for process in reversed(self._processes):
            process.terminate()
        for process in self._processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        self._processes.clear()

    def __enter__(self) -> "LocalGCS":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    serve_proxy(*sys.argv[1:5])
