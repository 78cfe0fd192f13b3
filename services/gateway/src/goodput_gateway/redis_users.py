"""``python -m goodput_gateway.redis_users``: the chart's install hook (the gateway's image runs it). Creates the
Redis ACL users of ``--namespace`` (:mod:`goodput_contracts.redis_access`: one per service, limited to its keys) on
every ``--admin-url``, with that URL's (an administrator's) credentials. Identity ``x``'s password is in env
``GOODPUT_REDIS_PASSWORD_<X>`` (upper case); the key prefixes in the same env the services get them in.
"""

from __future__ import annotations

import argparse
import os
import sys
from urllib.parse import urlsplit

import redis

from goodput_contracts.redis_access import REDIS_ACCESS, apply


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m goodput_gateway.redis_users")
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--admin-url", action="append", required=True)
    args = parser.parse_args(argv)
    users = {i: (os.environ[f"GOODPUT_REDIS_PASSWORD_{i.upper()}"], os.environ) for i in REDIS_ACCESS
             if f"GOODPUT_REDIS_PASSWORD_{i.upper()}" in os.environ}
    for url in args.admin_url:
        with redis.Redis.from_url(url, socket_timeout=10) as client:
            apply(client, args.namespace, users)
        print(f"redis users of {args.namespace} ({', '.join(users)}) set on {urlsplit(url).hostname}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
