"""Show what an editor shows: run yaml-language-server on a recipe and print its diagnostics.

yaml-language-server is the server behind VS Code's YAML extension (redhat.vscode-yaml) and
Neovim's ``yamlls``; both pass it the document and print what it publishes. This script does
the same over stdio (Language Server Protocol), so the schema wiring of docs/editor.md can be
checked without an editor. It needs Node.js and the server
(``npm install yaml-language-server``); it is not part of the test suite.

Usage::

    python tools/editor_diagnostics.py --server node_modules/.bin/yaml-language-server \\
        recipes/llama.yaml [MORE.yaml ...] [--typo]

``--typo`` opens each file with ``style: colwise`` changed to ``style: colwse`` (the README's
example) and one placement changed to ``shard(x)``, as if typed in the editor; the file on disk
is not touched. The document keeps its path, so the ``# yaml-language-server: $schema=`` line
resolves as it would in the editor.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any


def _send(stream: IO[bytes], message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    stream.write(f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    stream.flush()


def _receive(stream: IO[bytes]) -> dict[str, Any]:
    length = 0
    while True:
        line = stream.readline()
        if not line:
            raise EOFError("the server closed its output")
        if line in (b"\r\n", b"\n"):
            break
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    message: dict[str, Any] = json.loads(stream.read(length))
    return message


def diagnostics(server: str, path: Path, text: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Open ``text`` as the document at ``path`` and return the diagnostics the server sends."""
    proc = subprocess.Popen([server, "--stdio"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    uri = path.resolve().as_uri()
    settings = {"yaml": {"validate": True, "hover": True, "completion": True,
                         "schemaStore": {"enable": False}}}
    try:
        _send(proc.stdin, {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "processId": None, "rootUri": path.resolve().parent.parent.as_uri(),
            "capabilities": {"workspace": {"configuration": True}},
            "initializationOptions": settings}})
        deadline = time.monotonic() + timeout_s
        opened = False
        while time.monotonic() < deadline:
            msg = _receive(proc.stdout)
            if msg.get("id") == 1 and not opened:
                _send(proc.stdin, {"jsonrpc": "2.0", "method": "initialized", "params": {}})
                _send(proc.stdin, {"jsonrpc": "2.0", "method": "workspace/didChangeConfiguration",
                                   "params": {"settings": settings}})
                _send(proc.stdin, {"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {
                    "textDocument": {"uri": uri, "languageId": "yaml", "version": 1,
                                     "text": text}}})
                opened = True
            elif msg.get("method") == "workspace/configuration":
                items = msg["params"]["items"]
                _send(proc.stdin, {"jsonrpc": "2.0", "id": msg["id"],
                                   "result": [settings.get(i.get("section", ""), settings)
                                              if i.get("section") != "yaml" else settings["yaml"]
                                              for i in items]})
            elif "id" in msg and "method" in msg:  # any other request: answer with nothing
                _send(proc.stdin, {"jsonrpc": "2.0", "id": msg["id"], "result": None})
            elif (msg.get("method") == "textDocument/publishDiagnostics"
                  and msg["params"]["uri"] == uri):
                found: list[dict[str, Any]] = msg["params"]["diagnostics"]
                return found
        raise TimeoutError(f"no diagnostics for {path} within {timeout_s} s")
    finally:
        proc.kill()
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="yaml-language-server")
    parser.add_argument("--typo", action="store_true")
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    for path in args.files:
        text = path.read_text(encoding="utf-8")
        if args.typo:
            text = text.replace("style: colwise\n", "style: colwse\n", 1)
            text = text.replace("shard(1)", "shard(x)", 1)
        found = diagnostics(args.server, path, text)
        print(f"{path}: {len(found)} diagnostic(s)")
        for d in found:
            start = d["range"]["start"]
            print(f"  {path}:{start['line'] + 1}:{start['character'] + 1}: "
                  f"{' '.join(d['message'].split())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
