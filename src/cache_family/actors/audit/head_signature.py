"""The journal's head, and its optional signature with an operator-held SSH key.

Anyone able to write the run directory can rewrite the whole chain and re-fold every receipt:
only a head kept apart from it (``replay --expect-head``), or a signature made with a key the
writer does not hold, catches that. Signing is OpenSSH's own (``ssh-keygen -Y sign``, SSHSIG),
never a home-made scheme, over the head line and a newline exactly as the run printed it, in
``SIGNATURE_NAMESPACE`` so a signature made for anything else never verifies here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from typing import Final

from cache_family.errors import Refusal, Refused
from cache_family.schemas.bounded import read_bounded
from cache_family.system.publish import replace_atomically

SIGNATURE_FILENAME: Final = "journal.head.sig"
SIGNATURE_NAMESPACE: Final = "cache-family-journal"
# An SSHSIG armoured signature is well under a kibibyte; anything far larger is not one.
SIGNATURE_MAX_BYTES: Final = 64 * 1024
SSH_KEYGEN_TIMEOUT_S: Final = 60.0
HEAD_PATTERN: Final = re.compile(r"[0-9a-f]{64}")
# ssh-keygen gets this environment and nothing of the caller's: no agent socket, no locale,
# no HOME-relative configuration changes what is signed or how it is verified.
_SSH_KEYGEN_ENV: Final = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}


def head_line(head: str) -> str:
    """The run's very last line: the sealed journal's head, for the auditor's notes."""
    return f"journal head: sha256 {head}"


def head_message(head: str) -> bytes:
    """The bytes a head signature signs: the head line the run printed, newline-terminated."""
    return (head_line(head) + "\n").encode()


def ssh_keygen() -> str:
    """The absolute path of OpenSSH's ssh-keygen, or a refusal saying it is missing."""
    found = shutil.which("ssh-keygen", path=_SSH_KEYGEN_ENV["PATH"])
    if found is None:
        raise Refused.one(
            "journal.sign.no_ssh_keygen",
            "$.ssh_keygen",
            f"ssh-keygen (OpenSSH) is not in {_SSH_KEYGEN_ENV['PATH']}",
            "install OpenSSH's client tools (Debian: openssh-client) to sign or verify heads",
        )
    return found


def _run(argv: list[str], message: bytes) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        argv,
        input=message,
        capture_output=True,
        env=dict(_SSH_KEYGEN_ENV),
        timeout=SSH_KEYGEN_TIMEOUT_S,
        check=False,
    )


def _first_line(data: bytes) -> str:
    text = data.decode(errors="replace").strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def signature_bytes(key_path: str, head: str) -> bytes:
    """Sign the head with the private key at ``key_path``; the armoured SSHSIG bytes.

    The key must be usable without a passphrase prompt (the run has no terminal to ask on):
    a dedicated signing key, e.g. ``ssh-keygen -t ed25519 -N '' -f journal-signing-key``.
    """
    argv = [ssh_keygen(), "-Y", "sign", "-f", key_path, "-n", SIGNATURE_NAMESPACE]
    try:
        done = _run(argv, head_message(head))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise Refused.one(
            "journal.sign.failed",
            "$.sign_key",
            f"ssh-keygen could not sign with {key_path}: {exc}",
            "give --sign-key an unencrypted OpenSSH private key the runner can read",
        ) from None
    if done.returncode != 0 or not done.stdout.startswith(b"-----BEGIN SSH SIGNATURE-----"):
        raise Refused.one(
            "journal.sign.failed",
            "$.sign_key",
            f"ssh-keygen could not sign with {key_path}: {_first_line(done.stderr)}",
            "give --sign-key an unencrypted OpenSSH private key the runner can read",
        )
    return done.stdout


def check_sign_key(key_path: str) -> None:
    """Sign a probe before the run starts, so a key that cannot sign refuses the run instead
    of failing after hours of measurement."""
    signature_bytes(key_path, "0" * 64)


def sign_head(run_dir: str, key_path: str, head: str) -> str:
    """Write ``journal.head.sig`` beside the journal, atomically; its path. A resumed run
    signs its new head over the previous segment's signature."""
    path = os.path.join(run_dir, SIGNATURE_FILENAME)
    try:
        replace_atomically(path, signature_bytes(key_path, head))
    except OSError as exc:
        raise Refused.one(
            "journal.sign.failed",
            "$.sign_key",
            f"the head signature {path} was not written: {exc}",
            "check free space and permissions of the run directory",
        ) from None
    return path


def verify_head(run_dir: str, head: str, allowed_signers: str, identity: str) -> Refusal | None:
    """Check ``journal.head.sig`` against ``head``: None when it verifies for ``identity``
    under ``allowed_signers`` (ssh-keygen's file format), else why not."""
    path = os.path.join(run_dir, SIGNATURE_FILENAME)
    try:
        signature = read_bounded(path, SIGNATURE_MAX_BYTES, what="head signature").data
    except Refused as refused:
        missing = refused.codes == ["file.missing"]
        return Refusal(
            "replay.signature.missing" if missing else "replay.signature.unreadable",
            "$.journal_head_signature",
            f"{path}: {refused.refusals[0].message}",
            "run with --sign-key to sign the head, or replay without --allowed-signers",
        )
    try:
        tool = ssh_keygen()
    except Refused as refused:
        return refused.refusals[0]
    with tempfile.TemporaryDirectory(prefix="cache-family-verify-") as scratch:
        # Verify the bytes read (and bounded) here, not a file that could change meanwhile.
        copy = os.path.join(scratch, SIGNATURE_FILENAME)
        with open(copy, "wb") as handle:
            handle.write(signature)
        argv = [tool, "-Y", "verify", "-f", allowed_signers, "-I", identity]
        argv += ["-n", SIGNATURE_NAMESPACE, "-s", copy]
        try:
            done = _run(argv, head_message(head))
        except (OSError, subprocess.TimeoutExpired) as exc:
            done = None
            reason = str(exc)
    if done is not None and done.returncode == 0:
        return None
    if done is not None:
        reason = _first_line(done.stderr + done.stdout)
    return Refusal(
        "replay.signature.invalid",
        "$.journal_head_signature",
        f"{path} does not verify the head {head} for {identity!r}: {reason}",
        "the journal was rewritten after it was signed, or another key signed it",
    )
