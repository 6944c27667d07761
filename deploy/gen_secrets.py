"""Write the secrets compose.yaml requires into .env, each a fresh random value.

    python3 deploy/gen_secrets.py [--env-file .env]

compose.yaml has no default for any of them (``${VAR:?...}``: compose refuses to start without
it), so no password lives in the repository. This writes what is missing: the gateway's API key
(``MESHSERVE_API_KEYS``), one NATS password per service (``NATS_PASSWORD_<SERVICE>``, the users
of deploy/nats/nats-server.conf) and Grafana's admin password. A variable the file already sets
is kept as it is, so running it again, or after adding your own settings, changes nothing else.
The file is made readable by its owner only.

Plain Python 3.11+ and no dependency beyond this repository: it runs on a Docker host where
meshserve itself is not installed.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the repository's own modules

from common.nats_permissions import ROLES, password_variable  # noqa: E402

API_KEYS = "MESHSERVE_API_KEYS"
ASSIGNMENT = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=", re.MULTILINE)


def required_variables() -> list[str]:
    return [API_KEYS, *(password_variable(role) for role in ROLES), "GRAFANA_ADMIN_PASSWORD"]


def fresh_value(name: str) -> str:
    # 32 random bytes, URL-safe base64: no character compose or a shell would interpret.
    token = secrets.token_urlsafe(32)
    return f"msk-{token}" if name == API_KEYS else token


def write_secrets(env_file: Path) -> list[str]:
    """Add every missing required variable to ``env_file``; return the names added."""
    text = env_file.read_text() if env_file.exists() else ""
    present = set(ASSIGNMENT.findall(text))
    missing = [name for name in required_variables() if name not in present]
    if missing:
        lines = [] if not text or text.endswith("\n") else [""]
        lines += ["# Secrets written by deploy/gen_secrets.py; keep this file private."]
        lines += [f"{name}={fresh_value(name)}" for name in missing]
        # Created owner-only from the start: the secrets are never readable by others.
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as out:
            out.write("\n".join(lines) + "\n")
    env_file.chmod(0o600)
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 deploy/gen_secrets.py",
        description="write random values for the secrets compose.yaml requires into .env",
    )
    parser.add_argument("--env-file", type=Path, default=ROOT / ".env")
    args = parser.parse_args(argv)
    added = write_secrets(args.env_file)
    if added:
        sys.stdout.write(f"{args.env_file}: added {', '.join(added)}\n")
    else:
        sys.stdout.write(f"{args.env_file}: every secret is already set; nothing changed\n")
    if API_KEYS in added:
        sys.stdout.write(f"clients send: Authorization: Bearer <{API_KEYS} from {args.env_file}>\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
