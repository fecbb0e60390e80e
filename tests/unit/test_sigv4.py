"""The lean GET's signer (tierfs/store/sigv4.py) against botocore's S3SigV4Auth:
the same headers, byte for byte, for the same request at the same second."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.utils import percent_encode

from tierfs.store.sigv4 import GetSigner, signed_host

KEYS = ["train/img-00001.jpg", "a b/ü+?#=&%/x~y", "ckpt/__0_0.distcp", "x" * 300]
HEADERS = [{"Range": "bytes=0-102399"}, {"Range": "bytes=5-9", "If-Match": '"abc-3"'}]


def botocore_headers(url: str, headers: dict[str, str], creds: Credentials, region: str,
                     sign_payload: bool) -> dict[str, str]:
    request = AWSRequest(method="GET", url=url, headers=dict(headers))
    request.context["client_config"] = Config(s3={"payload_signing_enabled": sign_payload})
    S3SigV4Auth(creds, "s3", region).add_auth(request)
    return dict(request.headers.items())


@pytest.mark.parametrize("origin", ["http://127.0.0.1:8333", "https://s3.example.com",
                                    "https://s3.example.com:8443", "http://[::1]:9000"])
@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzEJr//////////wEaDM+/token="])
@pytest.mark.parametrize("sign_payload", [False, True])
def test_same_headers_as_botocore(origin: str, token: str | None, sign_payload: bool) -> None:
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    signer = GetSigner(origin + "/bucket/k", "eu-west-3", sign_payload=sign_payload)
    for key in KEYS:
        for headers in HEADERS:
            path = "/bucket/" + percent_encode(key, safe="/~")
            want = botocore_headers(origin + path, headers, creds, "eu-west-3", sign_payload)
            at = datetime.strptime(want["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
            got = signer.sign(path, headers, creds.access_key, creds.secret_key, creds.token, at)
            assert got == want


def test_signing_key_follows_the_day_and_the_secret() -> None:
    """A new day, or credentials refreshed in place, sign with a new key: the
    signer that keeps its key signs as a new signer does."""
    url = "http://127.0.0.1:8333/b/k"
    kept = GetSigner(url, "us-east-1", sign_payload=False)
    day1 = datetime(2026, 12, 6, 23, 59, 59, tzinfo=UTC)
    day2 = datetime(2026, 12, 7, 0, 0, 1, tzinfo=UTC)
    seen = set()
    for at, secret in ((day1, "s1"), (day2, "s1"), (day2, "s2"), (day1, "s1")):
        fresh = GetSigner(url, "us-east-1", sign_payload=False)
        got = kept.sign("/b/k", {}, "AK", secret, None, at)
        assert got == fresh.sign("/b/k", {}, "AK", secret, None, at)
        seen.add(got["Authorization"])
    assert len(seen) == 3  # (day1, s1) twice


def test_signed_host_drops_default_ports() -> None:
    assert signed_host("http://h:80/b") == "h"
    assert signed_host("https://h:443/b") == "h"
    assert signed_host("http://h:443/b") == "h:443"
    assert signed_host("http://[::1]:9000/b") == "[::1]:9000"
