"""Rank credentials: what makes a process a rank of the run, beyond the run secret.

The run secret lets a process talk to the run (CURVE, the MACs); it does not say which
rank a process is, and every process of a run holds it. So each rank is also handed a
key of its own, its *credential*, and the rendezvous checks a hello (and every later
message signed for a rank of the run) against that rank's credential before it changes
anything about the name (hw/control/membership.py): holding `run.secret` alone registers
as nobody.

Credentials are derived, per rank name, from a master key the rendezvous draws when it
starts and never writes nor sends (`Credentials`): HKDF-SHA256(salt = master, info =
label | name). A rank's messages to the rendezvous are then signed with
`keys.rank_key(run secret, direction, name, incarnation, credential)`, which needs both.

How a rank gets its own credential, and nobody else's:
- spawned or forked by the launcher: over a pipe whose read end is the only descriptor
  it inherits for it (`KEY_FD_ENV` names the descriptor's number, not the key); the
  launcher writes the key and closes its end before the rank starts, the rank reads it
  once and closes it (`read_credential`). Never argv, never the environment.
- started elsewhere (`kvstage hw --no-spawn`: by hand, srun, torchrun), or started again
  by hand (`--rejoin-grace`, prefill ranks only): from a file `RUN_DIR/keys/<name>.key`
  the launcher writes owner-only (0600, O_EXCL | O_NOFOLLOW, in a 0700 directory) next
  to `run.secret`; `kvstage hw-rank` reads the file of its own name (or `--key-file`).
  The file stays for the run, so the rank can be started again: a process of the run's
  own user can read it (as it can `run.secret`); against that the rendezvous fails the
  run when a name is claimed twice, naming both claimants.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvstage.hw.control.plane import RunSecretError, read_secret_file, write_secret_file

CREDENTIAL_BYTES = 32
KEY_FD_ENV = "KVSTAGE_RANK_KEY_FD"  # the number of the inherited descriptor to read it from
KEYS_DIR = "keys"  # RUN_DIR/keys/<name>.key, for ranks the launcher does not start
_LABEL = b"kvstage rank credential v1"
_CURVE = b"kvstage rendezvous curve client v1"


class CredentialError(RunSecretError):
    """No usable credential: a rank that cannot prove its name does not start."""


class Credentials:
    """The rendezvous's master key (drawn here: never stored, never sent) and the
    credential of each rank name derived from it."""

    def __init__(self) -> None:
        self._master = secrets.token_bytes(CREDENTIAL_BYTES)
        self._of: dict[str, bytes] = {}

    def of(self, name: str) -> bytes:
        """The credential of rank `name`."""
        if name not in self._of:
            hkdf = HKDF(
                algorithm=hashes.SHA256(),
                length=CREDENTIAL_BYTES,
                salt=self._master,
                info=_LABEL + name.encode(),
            )
            self._of[name] = hkdf.derive(b"")
        return self._of[name]


def curve_keys(credential: bytes) -> tuple[bytes, bytes]:
    """(public, secret) raw Curve25519 keys a rank connects to the rendezvous with,
    derived from its credential: the rendezvous knows every rank's public key before
    any connects, and counts each rank's connections (hw/control/zap.py)."""
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_CURVE)
    private = X25519PrivateKey.from_private_bytes(hkdf.derive(credential))
    return private.public_key().public_bytes_raw(), private.private_bytes_raw()


def key_file(run_dir: Path, name: str) -> Path:
    return run_dir / KEYS_DIR / f"{name}.key"


def write_key_files(run_dir: Path, credentials: Credentials, names: list[str]) -> None:
    """One owner-only key file per rank name in `run_dir/keys` (a 0700 directory); no
    directory when there are no names."""
    if not names:
        return
    keys = run_dir / KEYS_DIR
    keys.mkdir(mode=0o700, exist_ok=True)
    os.chmod(keys, 0o700)  # whatever the umask, or an older directory's mode
    for name in names:
        write_secret_file(key_file(run_dir, name), credentials.of(name))


def credential_pipe(credential: bytes) -> int:
    """A pipe holding `credential` (hex), written and closed: its read end, to be
    inherited by one rank process (and closed by whoever started it, once started)."""
    r, w = os.pipe()
    try:
        os.write(w, (credential.hex() + "\n").encode())
    finally:
        os.close(w)
    return r


def read_credential(name: str, key_path: str | None, secret_path: str | None) -> bytes:
    """This rank's credential: `key_path` if given, else the descriptor named in
    $KVSTAGE_RANK_KEY_FD (read once, closed, the variable dropped), else the key file of
    `name` next to the run secret file `secret_path`. CredentialError naming what is
    missing otherwise."""
    if key_path is not None:
        return _read_file(key_path, name)
    fd_text = os.environ.pop(KEY_FD_ENV, "")
    if fd_text:
        return _read_fd(fd_text, name)
    if secret_path is not None:
        path = key_file(Path(secret_path).parent, name)
        if path.exists():
            return _read_file(str(path), name)
        raise CredentialError(
            f"no credential for {name}: no {path} (`kvstage hw --no-spawn` writes one per rank "
            f"next to run.secret) and no --key-file; the run secret alone registers as no rank"
        )
    raise CredentialError(
        f"no credential for {name}: give --key-file RUN_DIR/keys/{name}.key (or --secret-file "
        f"RUN_DIR/run.secret, next to which the key files lie); ranks `kvstage hw` starts "
        f"inherit theirs (${KEY_FD_ENV})"
    )


def _read_file(path: str, name: str) -> bytes:
    try:
        return read_secret_file(path, what=f"{name}'s credential")
    except RunSecretError as exc:
        raise CredentialError(str(exc)) from None


def _read_fd(fd_text: str, name: str) -> bytes:
    try:
        fd = int(fd_text)
        try:
            text = os.read(fd, 4096).decode(errors="replace")
        finally:
            os.close(fd)
    except (ValueError, OSError) as exc:
        raise CredentialError(
            f"cannot read {name}'s credential from descriptor ${KEY_FD_ENV}={fd_text[:20]!r}: {exc}"
        ) from None
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != CREDENTIAL_BYTES:
        raise CredentialError(
            f"descriptor ${KEY_FD_ENV}={fd_text} held no credential "
            f"({2 * CREDENTIAL_BYTES} hex digits)"
        )
    return key
