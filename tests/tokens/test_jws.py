"""Pure tests for router.tokens: the episode token's format, verification and minting."""

from __future__ import annotations

import base64
import hmac
import json
import pickle
import random
from typing import cast

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

from router.tokens import (
    MAX_TOKEN_BYTES,
    EpisodeToken,
    SigningKey,
    TokenError,
    TokenVerifier,
    episode_key,
    mint_token,
    new_nonce,
    parse_token,
)
from router.tokens.cache import TokenCache

NOW = 1_700_000_000.0
SECRET = b"0123456789abcdef0123456789abcdef"
ALGS = ("HS256", "EdDSA", "ES256")
KEYS = {
    "HS256": SigningKey.hs256(SECRET),
    "EdDSA": SigningKey.generate("EdDSA"),
    "ES256": SigningKey.generate("ES256"),
}
GOOD_HEADER: dict[str, object] = {"alg": "HS256", "typ": "JWT"}
GOOD_PAYLOAD: dict[str, object] = {"ep": "ep7", "att": 2, "nonce": "n0nce", "iat": 1_000}
FAKE_SIGNATURE = bytes(32)
HS256_VERIFIER = TokenVerifier.hs256(SECRET)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def unb64(segment: str) -> bytes:
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


def json_bytes(value: dict[str, object] | bytes) -> bytes:
    if isinstance(value, bytes):
        return value
    return json.dumps(value, separators=(",", ":")).encode("utf-8")


def craft(
    header: dict[str, object] | bytes = GOOD_HEADER,
    payload: dict[str, object] | bytes = GOOD_PAYLOAD,
    signature: bytes = FAKE_SIGNATURE,
) -> str:
    """A token built by hand from chosen JSON bytes, with any signature bytes."""
    return f"{b64(json_bytes(header))}.{b64(json_bytes(payload))}.{b64(signature)}"


def hs256_by_hand(header: dict[str, object], payload: dict[str, object], secret: bytes) -> str:
    """An HS256 token from hmac + base64 + json alone, independent of mint_token."""
    signing_input = f"{b64(json_bytes(header))}.{b64(json_bytes(payload))}"
    signature = hmac.new(secret, signing_input.encode("ascii"), "sha256").digest()
    return f"{signing_input}.{b64(signature)}"


def with_payload(**changes: object) -> dict[str, object]:
    return {**GOOD_PAYLOAD, **changes}


def without(mapping: dict[str, object], name: str) -> dict[str, object]:
    return {key: value for key, value in mapping.items() if key != name}


def refused(token: str, *, verifier: TokenVerifier | None = None) -> TokenError:
    with pytest.raises(TokenError) as caught:
        parse_token(token, now=NOW, verifier=verifier)
    return caught.value


def mint(alg: str, **changes: object) -> str:
    claims: dict[str, object] = {"ep": "ep7", "att": 2, "nonce": "n0nce", "iat": 1_000}
    claims.update(changes)
    return mint_token(
        ep=cast(str, claims["ep"]),
        att=cast(int, claims["att"]),
        nonce=cast(str, claims["nonce"]),
        iat=cast(int, claims["iat"]),
        exp=cast("int | None", claims.get("exp")),
        kid=cast("str | None", claims.get("kid")),
        key=KEYS[alg],
    )


def independent_verifier(alg: str) -> TokenVerifier:
    """A verifier built from the public material, not from the SigningKey object."""
    if alg == "HS256":
        return TokenVerifier.hs256(SECRET)
    pem = KEYS[alg].public_pem()
    assert pem is not None
    return TokenVerifier.from_public_pem(pem)


# --- round trips -----------------------------------------------------------------------


@pytest.mark.parametrize("alg", ALGS)
def test_minted_token_round_trips_with_and_without_verification(alg: str) -> None:
    token = mint(alg, exp=int(NOW) + 60, kid="key-1")
    expected = EpisodeToken(
        ep="ep7", att=2, nonce="n0nce", iat=1_000, exp=int(NOW) + 60, alg=alg, kid="key-1"
    )
    assert parse_token(token, now=NOW) == expected
    assert parse_token(token, now=NOW, verifier=independent_verifier(alg)) == expected
    assert parse_token(token, now=NOW, verifier=KEYS[alg].verifier()) == expected


@pytest.mark.parametrize("alg", ALGS)
def test_minted_token_has_the_documented_wire_form(alg: str) -> None:
    token = mint(alg)
    header, payload, signature = token.split(".")
    assert json.loads(unb64(header)) == {"alg": alg, "typ": "JWT"}
    assert json.loads(unb64(payload)) == {"ep": "ep7", "att": 2, "nonce": "n0nce", "iat": 1_000}
    assert len(unb64(signature)) == {"HS256": 32, "EdDSA": 64, "ES256": 64}[alg]
    assert "=" not in token


def test_minted_es256_signature_is_raw_r_s_that_plain_ecdsa_accepts() -> None:
    token = mint("ES256")
    signing_input, _, signature_b64 = token.rpartition(".")
    signature = unb64(signature_b64)
    der = encode_dss_signature(
        int.from_bytes(signature[:32], "big"), int.from_bytes(signature[32:], "big")
    )
    public_pem = KEYS["ES256"].public_pem()
    assert public_pem is not None
    public_key = serialization.load_pem_public_key(public_pem)
    assert isinstance(public_key, ec.EllipticCurvePublicKey)
    public_key.verify(der, signing_input.encode("ascii"), ec.ECDSA(hashes.SHA256()))


def test_hs256_token_built_by_an_independent_implementation_parses() -> None:
    header: dict[str, object] = {"typ": "JWT", "alg": "HS256", "kid": "k9"}
    payload: dict[str, object] = {"iat": 5, "nonce": "xyz", "ep": "run:1.2_x-y", "sub": "extra"}
    token = hs256_by_hand(header, payload, SECRET)
    assert parse_token(token, now=NOW, verifier=HS256_VERIFIER) == EpisodeToken(
        ep="run:1.2_x-y", att=0, nonce="xyz", iat=5, exp=None, alg="HS256", kid="k9"
    )


def test_eddsa_and_es256_tokens_signed_directly_with_cryptography_parse() -> None:
    payload = b64(json_bytes(GOOD_PAYLOAD))
    ed_key = ed25519.Ed25519PrivateKey.generate()
    ed_input = f"{b64(json_bytes({'alg': 'EdDSA'}))}.{payload}"
    ed_token = f"{ed_input}.{b64(ed_key.sign(ed_input.encode()))}"
    ec_key = ec.generate_private_key(ec.SECP256R1())
    ec_input = f"{b64(json_bytes({'alg': 'ES256'}))}.{payload}"
    r, s = decode_dss_signature(ec_key.sign(ec_input.encode(), ec.ECDSA(hashes.SHA256())))
    ec_token = f"{ec_input}.{b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"
    for token, public_key in ((ed_token, ed_key.public_key()), (ec_token, ec_key.public_key())):
        pem = public_key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        parsed = parse_token(token, now=NOW, verifier=TokenVerifier.from_public_pem(pem))
        assert (parsed.ep, parsed.att, parsed.nonce, parsed.iat) == ("ep7", 2, "n0nce", 1_000)


# Known answers from the RFCs: RFC 7515 A.1 (HS256), A.3 (ES256), RFC 8037 A.4 (Ed25519).
RFC7515_PAYLOAD = (
    "eyJpc3MiOiJqb2UiLA0KICJleHAiOjEzMDA4MTkzODAsDQogImh0dHA6Ly9leGFtcGxlLmNvbS9pc19yb290Ijp0cnVlfQ"
)
RFC7515_A1 = (
    f"eyJ0eXAiOiJKV1QiLA0KICJhbGciOiJIUzI1NiJ9.{RFC7515_PAYLOAD}"
    ".dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"
)
RFC7515_A1_KEY = unb64(
    "AyM1SysPpbyDfgZld3umj1qzKObwVMkoqQ-EstJQLr_T-1qS0gZH75aKtMN3Yj0iPS4hcgUuTwjAzZr1Z9CAow"
)
RFC7515_A3 = (
    f"eyJhbGciOiJFUzI1NiJ9.{RFC7515_PAYLOAD}"
    ".DtEhU3ljbEg8L38VWAfUAqOyKAM6-Xx-F4GawxaepmXFCgfTjDxw5djxLa8ISlSApmWQxfKTUJqPP3-Kg6NU1Q"
)
RFC7515_A3_XY = (
    "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU",
    "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0",
)
RFC8037_A4 = (
    "eyJhbGciOiJFZERTQSJ9.RXhhbXBsZSBvZiBFZDI1NTE5IHNpZ25pbmc"
    ".hgyY0il_MGCjP0JzlnLWG1PPOt7-09PGcvMg3AIbQR6dWbhijcNR4ki4iylGjg5BhVsPt9g7sVvpAr_MuM0KAg"
)
RFC8037_A4_X = "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"


def pem_of(public_key: ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def rfc_verifiers() -> list[tuple[str, str, TokenVerifier]]:
    x, y = (int.from_bytes(unb64(part), "big") for part in RFC7515_A3_XY)
    es256 = ec.EllipticCurvePublicNumbers(x, y, ec.SECP256R1()).public_key()
    eddsa = ed25519.Ed25519PublicKey.from_public_bytes(unb64(RFC8037_A4_X))
    return [
        ("HS256", RFC7515_A1, TokenVerifier.hs256(RFC7515_A1_KEY)),
        ("ES256", RFC7515_A3, TokenVerifier.from_public_pem(pem_of(es256))),
        ("EdDSA", RFC8037_A4, TokenVerifier.from_public_pem(pem_of(eddsa))),
    ]


@pytest.mark.parametrize(("alg", "token", "verifier"), rfc_verifiers(), ids=ALGS)
def test_verifier_accepts_rfc_known_answers(alg: str, token: str, verifier: TokenVerifier) -> None:
    signing_input, _, signature = token.rpartition(".")
    assert verifier.alg == alg
    verifier.verify(alg, signing_input.encode("ascii"), unb64(signature))
    flipped = bytes([unb64(signature)[0] ^ 1]) + unb64(signature)[1:]
    with pytest.raises(TokenError) as caught:
        verifier.verify(alg, signing_input.encode("ascii"), flipped)
    assert caught.value.code == "bad_signature"


def test_rfc7515_token_is_structurally_read_then_refused_for_missing_episode() -> None:
    # Its header has CRLF whitespace and typ before alg; its payload has no ep.
    for verifier in (None, TokenVerifier.hs256(RFC7515_A1_KEY)):
        error = refused(RFC7515_A1, verifier=verifier)
        assert (error.code, error.detail) == ("invalid_token", "The claim ep is missing.")


# --- verification failures -------------------------------------------------------------


def test_wrong_hs256_secret_is_bad_signature() -> None:
    error = refused(mint("HS256"), verifier=TokenVerifier.hs256(b"x" * 32))
    assert (error.code, error.status) == ("bad_signature", 403)
    assert error.detail == "The token's signature does not match the key."


@pytest.mark.parametrize("alg", ["EdDSA", "ES256"])
def test_wrong_public_key_is_bad_signature(alg: str) -> None:
    other = SigningKey.generate(alg).public_pem()
    assert other is not None
    error = refused(mint(alg), verifier=TokenVerifier.from_public_pem(other))
    assert (error.code, error.detail) == (
        "bad_signature",
        "The token's signature does not match the key.",
    )


@pytest.mark.parametrize(
    ("token_alg", "verifier_alg"),
    [(a, b) for a in ALGS for b in ALGS if a != b],
)
def test_alg_mismatch_between_token_and_verifier_is_bad_signature(
    token_alg: str, verifier_alg: str
) -> None:
    error = refused(mint(token_alg), verifier=independent_verifier(verifier_alg))
    assert (error.code, error.status) == ("bad_signature", 403)
    assert error.detail == (
        f"The token is signed with '{token_alg}' but the router verifies {verifier_alg}."
    )


def test_hs256_token_keyed_with_the_public_pem_is_refused_by_an_eddsa_verifier() -> None:
    # The classic alg-confusion forgery: HMAC keyed with the verifier's public key.
    public_pem = KEYS["EdDSA"].public_pem()
    assert public_pem is not None
    forged = hs256_by_hand(GOOD_HEADER, GOOD_PAYLOAD, public_pem)
    error = refused(forged, verifier=independent_verifier("EdDSA"))
    assert error.code == "bad_signature"


@pytest.mark.parametrize("alg", ALGS)
def test_tampered_payload_is_bad_signature(alg: str) -> None:
    header, _, signature = mint(alg).split(".")
    tampered = f"{header}.{b64(json_bytes(with_payload(att=3)))}.{signature}"
    assert parse_token(tampered, now=NOW).att == 3  # structurally fine: only a key can tell
    error = refused(tampered, verifier=independent_verifier(alg))
    assert (error.code, error.detail) == (
        "bad_signature",
        "The token's signature does not match the key.",
    )


@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("index", [0, 31, -1])
def test_tampered_signature_is_bad_signature(alg: str, index: int) -> None:
    signing_input, _, signature_b64 = mint(alg).rpartition(".")
    signature = bytearray(unb64(signature_b64))
    signature[index] ^= 0x01
    error = refused(f"{signing_input}.{b64(bytes(signature))}", verifier=independent_verifier(alg))
    assert (error.code, error.detail) == (
        "bad_signature",
        "The token's signature does not match the key.",
    )


@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("change", ["truncated", "extended", "single byte"])
def test_wrong_length_signature_is_bad_signature_only_when_verifying(alg: str, change: str) -> None:
    signing_input, _, signature_b64 = mint(alg).rpartition(".")
    signature = unb64(signature_b64)
    altered = {
        "truncated": signature[:-1],
        "extended": signature + b"\x00",
        "single byte": signature[:1],
    }[change]
    token = f"{signing_input}.{b64(altered)}"
    assert parse_token(token, now=NOW).alg == alg
    error = refused(token, verifier=independent_verifier(alg))
    expected = len(signature)
    assert (error.code, error.detail) == (
        "bad_signature",
        f"An {alg} signature is {expected} bytes long, not {len(altered)}.",
    )


def test_es256_signature_in_der_form_is_bad_signature() -> None:
    signing_input = craft({"alg": "ES256"}).rpartition(".")[0]
    private_key = ec.generate_private_key(ec.SECP256R1())
    der = private_key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256()))
    verifier = TokenVerifier.from_public_pem(pem_of(private_key.public_key()))
    error = refused(f"{signing_input}.{b64(der)}", verifier=verifier)
    assert error.code == "bad_signature"
    assert error.detail.startswith("An ES256 signature is 64 bytes long, not ")


@pytest.mark.parametrize("raw", [bytes(64), b"\xff" * 64, bytes(32) + b"\x01" * 32])
def test_es256_out_of_range_r_s_is_bad_signature(raw: bytes) -> None:
    error = refused(craft({"alg": "ES256"}, signature=raw), verifier=independent_verifier("ES256"))
    assert (error.code, error.detail) == (
        "bad_signature",
        "The token's signature does not match the key.",
    )


def test_forged_signature_without_a_verifier_is_left_to_the_worker() -> None:
    token = craft(signature=b"forged")
    assert parse_token(token, now=NOW) == EpisodeToken(
        ep="ep7", att=2, nonce="n0nce", iat=1_000, exp=None, alg="HS256", kid=None
    )


# --- malformed tokens ------------------------------------------------------------------

VALID = craft()
HEADER_B64, PAYLOAD_B64, SIGNATURE_B64 = VALID.split(".")
DEEP = b'{"ep":"ep7","nonce":"n","iat":1,"x":' + b"[" * 1400 + b"]" * 1400 + b"}"

MALFORMED: list[tuple[str, str, str]] = [
    # (case id, token, exact detail)
    ("empty", "", "The token is empty."),
    ("over 4096", "a" * 4097, "The token is longer than the 4096-byte limit."),
    (
        "non-ascii",
        f"{HEADER_B64}.{PAYLOAD_B64}é.{SIGNATURE_B64}",
        "The token contains non-ASCII characters.",
    ),
    ("one segment", HEADER_B64, "The token has 1 segment, not the 3 of a compact JWS."),
    (
        "two segments",
        f"{HEADER_B64}.{PAYLOAD_B64}",
        "The token has 2 segments, not the 3 of a compact JWS.",
    ),
    (
        "four segments",
        f"{VALID}.{SIGNATURE_B64}",
        "The token has 4 segments, not the 3 of a compact JWS.",
    ),
    ("empty header", f".{PAYLOAD_B64}.{SIGNATURE_B64}", "The token's header segment is empty."),
    ("empty payload", f"{HEADER_B64}..{SIGNATURE_B64}", "The token's payload segment is empty."),
    ("empty signature", f"{HEADER_B64}.{PAYLOAD_B64}.", "The token's signature segment is empty."),
    ("only dots", "..", "The token's header segment is empty."),
    (
        "plus",
        f"{HEADER_B64}+.{PAYLOAD_B64}.{SIGNATURE_B64}",
        "The token's header segment contains '+', outside the base64url alphabet.",
    ),
    (
        "slash",
        f"{HEADER_B64}.{PAYLOAD_B64}/.{SIGNATURE_B64}",
        "The token's payload segment contains '/', outside the base64url alphabet.",
    ),
    (
        "space",
        f"{HEADER_B64}.{PAYLOAD_B64}.{SIGNATURE_B64} ",
        "The token's signature segment contains ' ', outside the base64url alphabet.",
    ),
    (
        "padding",
        f"{HEADER_B64}.{b64(b'{}')}=.{SIGNATURE_B64}",
        "The token's payload segment has '=' padding, which a compact JWS never carries.",
    ),
    (
        "padding signature",
        f"{HEADER_B64}.{PAYLOAD_B64}.{b64(b'x')}==",
        "The token's signature segment has '=' padding, which a compact JWS never carries.",
    ),
    (
        "length 1 mod 4",
        f"{HEADER_B64}.{PAYLOAD_B64}.abcde",
        "The token's signature segment has 5 characters, a length no base64url encoding has.",
    ),
    (
        "non-canonical 3-char tail",
        f"e31.{PAYLOAD_B64}.{SIGNATURE_B64}",
        "The token's header segment has unused trailing bits set (not canonical base64url).",
    ),
    (
        "non-canonical 2-char tail",
        f"{HEADER_B64}.{PAYLOAD_B64}.QR",
        "The token's signature segment has unused trailing bits set (not canonical base64url).",
    ),
    (
        "header not utf-8",
        craft(b'{"alg":"HS256","x":"\xff"}'),
        "The token's header is not valid UTF-8.",
    ),
    (
        "payload utf-16",
        craft(payload=json.dumps(GOOD_PAYLOAD).encode("utf-16")),
        "The token's payload is not valid UTF-8.",
    ),
    (
        "payload utf-16-le",
        craft(payload=json.dumps(GOOD_PAYLOAD).encode("utf-16-le")),
        "The token's payload is not valid JSON.",
    ),
    (
        "payload utf-8 bom",
        craft(payload=b"\xef\xbb\xbf" + json_bytes(GOOD_PAYLOAD)),
        "The token's payload is not valid JSON.",
    ),
    ("header not json", craft(b"{alg: HS256}"), "The token's header is not valid JSON."),
    (
        "payload trailing data",
        craft(payload=json_bytes(GOOD_PAYLOAD) + b"{}"),
        "The token's payload is not valid JSON.",
    ),
    ("payload nested too deep", craft(payload=DEEP), "The token's payload is not valid JSON."),
    ("header array", craft(b'["HS256"]'), "The token's header is an array, not a JSON object."),
    ("header null", craft(b"null"), "The token's header is null, not a JSON object."),
    (
        "payload string",
        craft(payload=b'"ep7"'),
        "The token's payload is a string, not a JSON object.",
    ),
    (
        "payload number",
        craft(payload=b"7"),
        "The token's payload is an integer, not a JSON object.",
    ),
    (
        "duplicate alg",
        craft(b'{"alg":"HS256","alg":"none"}'),
        "The token's header has the key 'alg' more than once.",
    ),
    (
        "duplicate ep",
        craft(payload=b'{"ep":"a","ep":"b","nonce":"n","iat":1}'),
        "The token's payload has the key 'ep' more than once.",
    ),
    (
        "duplicate nested",
        craft(payload=b'{"ep":"a","nonce":"n","iat":1,"x":{"k":1,"k":2}}'),
        "The token's payload has the key 'k' more than once.",
    ),
    (
        "NaN",
        craft(payload=b'{"ep":"a","nonce":"n","iat":NaN}'),
        "The token's payload contains NaN, which is not JSON.",
    ),
    (
        "Infinity",
        craft(payload=b'{"ep":"a","nonce":"n","iat":1,"exp":Infinity}'),
        "The token's payload contains Infinity, which is not JSON.",
    ),
    (
        "-Infinity",
        craft(payload=b'{"ep":"a","nonce":"n","iat":-Infinity}'),
        "The token's payload contains -Infinity, which is not JSON.",
    ),
    ("alg missing", craft({"typ": "JWT"}), "The token's header has no alg."),
    ("alg null", craft({"alg": None}), "The token's alg must be a string, not null."),
    ("alg number", craft({"alg": 256}), "The token's alg must be a string, not an integer."),
    ("alg list", craft({"alg": ["HS256"]}), "The token's alg must be a string, not an array."),
    (
        "alg none",
        craft({"alg": "none"}),
        "The token is unsecured (alg none), which is never accepted.",
    ),
    (
        "alg NONE",
        craft({"alg": "NONE"}),
        "The token is unsecured (alg none), which is never accepted.",
    ),
    (
        "alg None",
        craft({"alg": "None"}),
        "The token is unsecured (alg none), which is never accepted.",
    ),
    (
        "alg RS256",
        craft({"alg": "RS256"}),
        "The token's alg 'RS256' is not one of HS256, EdDSA, ES256.",
    ),
    (
        "alg hs256",
        craft({"alg": "hs256"}),
        "The token's alg 'hs256' is not one of HS256, EdDSA, ES256.",
    ),
    (
        "alg long",
        craft({"alg": "A" * 500}),
        f"The token's alg '{'A' * 36}... is not one of HS256, EdDSA, ES256.",
    ),
    (
        "typ number",
        craft({"alg": "HS256", "typ": 1}),
        "The token's typ must be a string, not an integer.",
    ),
    (
        "typ null",
        craft({"alg": "HS256", "typ": None}),
        "The token's typ must be a string, not null.",
    ),
    (
        "typ JOSE",
        craft({"alg": "HS256", "typ": "JOSE"}),
        "The token's typ 'JOSE' is not JWT, the only type accepted.",
    ),
    (
        "typ at+jwt",
        craft({"alg": "HS256", "typ": "at+jwt"}),
        "The token's typ 'at+jwt' is not JWT, the only type accepted.",
    ),
    (
        "kid number",
        craft({"alg": "HS256", "kid": 7}),
        "The token's kid must be a string, not an integer.",
    ),
    (
        "kid null",
        craft({"alg": "HS256", "kid": None}),
        "The token's kid must be a string, not null.",
    ),
    (
        "crit",
        craft({"alg": "HS256", "crit": ["exp"]}),
        "The token's header has crit; the router supports no JWS extensions.",
    ),
    (
        "crit empty",
        craft({"alg": "HS256", "crit": []}),
        "The token's header has crit; the router supports no JWS extensions.",
    ),
    ("ep missing", craft(payload=without(GOOD_PAYLOAD, "ep")), "The claim ep is missing."),
    (
        "ep number",
        craft(payload=with_payload(ep=7)),
        "The claim ep must be a string, not an integer.",
    ),
    ("ep null", craft(payload=with_payload(ep=None)), "The claim ep must be a string, not null."),
    (
        "ep empty",
        craft(payload=with_payload(ep="")),
        "The claim ep must be 1 to 128 characters long, not 0.",
    ),
    (
        "ep 129",
        craft(payload=with_payload(ep="e" * 129)),
        "The claim ep must be 1 to 128 characters long, not 129.",
    ),
    (
        "ep space",
        craft(payload=with_payload(ep="a b")),
        "The claim ep contains ' ', outside [A-Za-z0-9._:-].",
    ),
    (
        "ep accent",
        craft(payload=with_payload(ep="é")),
        "The claim ep contains 'é', outside [A-Za-z0-9._:-].",
    ),
    (
        "ep slash",
        craft(payload=with_payload(ep="ep/7")),
        "The claim ep contains '/', outside [A-Za-z0-9._:-].",
    ),
    (
        "ep newline",
        craft(payload=with_payload(ep="ep7\n")),
        "The claim ep contains '\\n', outside [A-Za-z0-9._:-].",
    ),
    ("att -1", craft(payload=with_payload(att=-1)), "The claim att must be 0 to 1000000, not -1."),
    (
        "att 1000001",
        craft(payload=with_payload(att=1_000_001)),
        "The claim att must be 0 to 1000000, not 1000001.",
    ),
    (
        "att true",
        craft(payload=with_payload(att=True)),
        "The claim att must be an integer, not a boolean.",
    ),
    (
        "att 1.0",
        craft(payload=with_payload(att=1.0)),
        "The claim att must be an integer, not a number with a fraction or exponent.",
    ),
    (
        "att string",
        craft(payload=with_payload(att="1")),
        "The claim att must be an integer, not a string.",
    ),
    (
        "att null",
        craft(payload=with_payload(att=None)),
        "The claim att must be an integer, not null.",
    ),
    ("nonce missing", craft(payload=without(GOOD_PAYLOAD, "nonce")), "The claim nonce is missing."),
    (
        "nonce number",
        craft(payload=with_payload(nonce=5)),
        "The claim nonce must be a string, not an integer.",
    ),
    (
        "nonce empty",
        craft(payload=with_payload(nonce="")),
        "The claim nonce must be 1 to 256 characters long, not 0.",
    ),
    (
        "nonce 257",
        craft(payload=with_payload(nonce="n" * 257)),
        "The claim nonce must be 1 to 256 characters long, not 257.",
    ),
    ("iat missing", craft(payload=without(GOOD_PAYLOAD, "iat")), "The claim iat is missing."),
    (
        "iat true",
        craft(payload=with_payload(iat=True)),
        "The claim iat must be an integer, not a boolean.",
    ),
    (
        "iat float",
        craft(payload=with_payload(iat=1.5)),
        "The claim iat must be an integer, not a number with a fraction or exponent.",
    ),
    (
        "iat exponent",
        craft(payload=b'{"ep":"a","nonce":"n","iat":1e3}'),
        "The claim iat must be an integer, not a number with a fraction or exponent.",
    ),
    (
        "iat string",
        craft(payload=with_payload(iat="1")),
        "The claim iat must be an integer, not a string.",
    ),
    (
        "iat null",
        craft(payload=with_payload(iat=None)),
        "The claim iat must be an integer, not null.",
    ),
    (
        "exp string",
        craft(payload=with_payload(exp="2000000000")),
        "The claim exp must be an integer, not a string.",
    ),
    (
        "exp float",
        craft(payload=with_payload(exp=2e9)),
        "The claim exp must be an integer, not a number with a fraction or exponent.",
    ),
    (
        "exp true",
        craft(payload=with_payload(exp=True)),
        "The claim exp must be an integer, not a boolean.",
    ),
    (
        "exp null",
        craft(payload=with_payload(exp=None)),
        "The claim exp must be an integer, not null.",
    ),
    (
        "expired",
        craft(payload=with_payload(exp=1_000)),
        "The token expired (exp 1000 is not after now 1700000000).",
    ),
]


@pytest.mark.parametrize("verifier", [None, HS256_VERIFIER], ids=["unverified", "verified"])
@pytest.mark.parametrize(
    ("token", "detail"), [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_malformed_token_is_invalid_token_even_when_verifying(
    token: str, detail: str, verifier: TokenVerifier | None
) -> None:
    error = refused(token, verifier=verifier)
    assert (error.code, error.status, error.detail) == ("invalid_token", 401, detail)


@pytest.mark.parametrize("value", [b"token", None, 42, ["a.b.c"]])
def test_non_string_token_is_invalid_token(value: object) -> None:
    error = refused(cast(str, value))
    assert error.code == "invalid_token"
    assert error.detail.startswith("The token is ") and error.detail.endswith(", not a string.")


@pytest.mark.parametrize("alg", ["none", "None", "NONE", "nOnE"])
def test_unsecured_token_with_empty_signature_is_refused(alg: str) -> None:
    signing_input = craft({"alg": alg}).rpartition(".")[0]
    for token in (f"{signing_input}.", f"{signing_input}.{b64(b'x')}"):
        for verifier in (None, HS256_VERIFIER):
            assert refused(token, verifier=verifier).code == "invalid_token"
    unsigned_detail = refused(f"{signing_input}.").detail
    assert unsigned_detail == "The token's signature segment is empty."
    signed_detail = refused(f"{signing_input}.{b64(b'x')}").detail
    assert signed_detail == "The token is unsecured (alg none), which is never accepted."


# --- claims accepted at their bounds ---------------------------------------------------


@pytest.mark.parametrize(
    ("header", "kid"),
    [
        ({"alg": "HS256"}, None),
        ({"alg": "HS256", "typ": "jwt"}, None),
        ({"alg": "HS256", "typ": "Jwt", "kid": ""}, ""),
        ({"alg": "HS256", "kid": "rotation-2", "cty": "x", "x5t": 1}, "rotation-2"),
    ],
)
def test_header_variants_accepted(header: dict[str, object], kid: str | None) -> None:
    parsed = parse_token(craft(header), now=NOW)
    assert (parsed.alg, parsed.kid) == ("HS256", kid)


def test_json_whitespace_around_and_inside_objects_is_accepted() -> None:
    header = b' \r\n{ "alg" : "HS256" }\n'
    payload = b'{"ep":"ep7",\t"nonce":"n",\n"iat":1}  '
    assert parse_token(craft(header, payload), now=NOW) == EpisodeToken(
        ep="ep7", att=0, nonce="n", iat=1, exp=None, alg="HS256", kid=None
    )


def test_att_absent_means_zero_and_unknown_claims_are_ignored() -> None:
    payload = {"ep": "ep7", "nonce": "n", "iat": -5, "sub": "x", "aud": ["a"], "nbf": 1.5}
    assert parse_token(craft(payload=payload), now=NOW) == EpisodeToken(
        ep="ep7", att=0, nonce="n", iat=-5, exp=None, alg="HS256", kid=None
    )


@pytest.mark.parametrize("att", [0, 1, 1_000_000])
def test_att_bounds_accepted(att: int) -> None:
    token = craft(payload=with_payload(att=att))
    assert parse_token(token, now=NOW).att == att
    assert parse_token(mint("ES256", att=att), now=NOW).key == f"ep7-a{att}"


@pytest.mark.parametrize("att", [-1, 1_000_001, True, 1.0, "1", None])
def test_att_out_of_bounds_or_wrong_type_refused_by_parser_and_minter(att: object) -> None:
    assert refused(craft(payload=with_payload(att=att))).code == "invalid_token"
    with pytest.raises(ValueError, match=r"^att (must be)"):
        mint("HS256", att=att)


@pytest.mark.parametrize("ep", ["a", "e" * 128, "AZaz09._:-", "env:run-1.ep_7"])
def test_ep_charset_and_length_accepted(ep: str) -> None:
    assert parse_token(craft(payload=with_payload(ep=ep)), now=NOW).ep == ep
    assert parse_token(mint("EdDSA", ep=ep), now=NOW).ep == ep


@pytest.mark.parametrize("ep", ["", "e" * 129, "a b", "é", "a/b", "a\x00", 7])
def test_bad_ep_refused_by_parser_and_minter(ep: object) -> None:
    assert refused(craft(payload=with_payload(ep=ep))).code == "invalid_token"
    with pytest.raises(ValueError, match=r"^ep (must|contains)"):
        mint("HS256", ep=ep)


@pytest.mark.parametrize("nonce", ["n", "n" * 256, "any chars: é /+=", "\u2603"])
def test_nonce_bounds_accepted(nonce: str) -> None:
    assert parse_token(craft(payload=with_payload(nonce=nonce)), now=NOW).nonce == nonce
    assert parse_token(mint("HS256", nonce=nonce), now=NOW).nonce == nonce


def test_expiry_boundary() -> None:
    at_now = craft(payload=with_payload(exp=int(NOW)))
    assert refused(at_now).detail == (
        "The token expired (exp 1700000000 is not after now 1700000000)."
    )
    assert refused(at_now, verifier=HS256_VERIFIER).code == "invalid_token"
    one_later = craft(payload=with_payload(exp=int(NOW) + 1))
    assert parse_token(one_later, now=NOW).exp == int(NOW) + 1
    assert parse_token(one_later, now=NOW + 0.999).exp == int(NOW) + 1
    with pytest.raises(TokenError) as caught:
        parse_token(one_later, now=NOW + 1)
    assert caught.value.detail == (
        "The token expired (exp 1700000001 is not after now 1700000001)."
    )


def test_expired_token_with_bad_signature_is_401_not_403() -> None:
    token = mint("HS256", exp=int(NOW) - 1)
    error = refused(token, verifier=TokenVerifier.hs256(b"y" * 32))
    assert (error.code, error.status) == ("invalid_token", 401)


# --- size limit ------------------------------------------------------------------------


def sized_claims(size: int) -> tuple[str, str]:
    """(kid, nonce) giving an HS256 token of exactly ``size`` characters, laid out as minted."""
    for nonce_length in range(1, 5):
        for kid_length in range(2_850, 3_050):
            header: dict[str, object] = {"alg": "HS256", "typ": "JWT", "kid": "k" * kid_length}
            payload = {"ep": "ep7", "att": 2, "nonce": "n" * nonce_length, "iat": 1_000}
            if len(hs256_by_hand(header, payload, SECRET)) == size:
                return "k" * kid_length, "n" * nonce_length
    raise AssertionError(f"no claims give a {size}-character token")


def test_token_of_exactly_4096_bytes_parses_and_4097_is_refused() -> None:
    kid, nonce = sized_claims(MAX_TOKEN_BYTES)
    largest = mint("HS256", kid=kid, nonce=nonce)
    assert len(largest) == MAX_TOKEN_BYTES
    assert parse_token(largest, now=NOW, verifier=HS256_VERIFIER).kid == kid

    kid, nonce = sized_claims(MAX_TOKEN_BYTES + 1)
    header: dict[str, object] = {"alg": "HS256", "typ": "JWT", "kid": kid}
    too_long = hs256_by_hand(header, with_payload(nonce=nonce), SECRET)
    assert len(too_long) == MAX_TOKEN_BYTES + 1
    for verifier in (None, HS256_VERIFIER):
        error = refused(too_long, verifier=verifier)
        assert (error.code, error.detail) == (
            "invalid_token",
            "The token is longer than the 4096-byte limit.",
        )
    with pytest.raises(ValueError, match=r"^the token would be 4097 bytes, over 4096$"):
        mint("HS256", kid=kid, nonce=nonce)


# --- robustness ------------------------------------------------------------------------


def test_mutated_tokens_only_ever_parse_or_raise_token_error() -> None:
    # Seeded and bounded: every single-character edit, deletion or insertion is
    # either still a token or a TokenError with a specific detail.
    rng = random.Random(20240601)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.=+/ \x00é"
    tokens = [mint(alg) for alg in ALGS]
    outcomes = {"parsed": 0, "invalid_token": 0, "bad_signature": 0}
    for _ in range(3_000):
        token = rng.choice(tokens)
        position = rng.randrange(len(token))
        edit = rng.choice(("replace", "delete", "insert"))
        char = rng.choice(alphabet.replace(token[position], ""))  # never the identity edit
        tail = token[position + 1 :] if edit != "insert" else token[position:]
        mutated = token[:position] + ("" if edit == "delete" else char) + tail
        alg = json.loads(unb64(token.split(".")[0]))["alg"]
        try:
            parse_token(mutated, now=NOW, verifier=independent_verifier(alg))
        except TokenError as error:
            assert error.detail != "The token is not a compact JWS."
            assert error.detail.endswith(".")
            outcomes[error.code] += 1
        else:
            outcomes["parsed"] += 1
    assert outcomes["invalid_token"] > 0 and outcomes["bad_signature"] > 0
    # A canonical encoding leaves a valid signature exactly one spelling.
    assert outcomes["parsed"] == 0


# --- keys and verifiers ----------------------------------------------------------------


def test_token_error_carries_code_detail_and_status() -> None:
    invalid = TokenError("invalid_token", "The token is empty.")
    forged = TokenError("bad_signature", "The token's signature does not match the key.")
    assert (invalid.code, invalid.detail, invalid.status, str(invalid)) == (
        "invalid_token",
        "The token is empty.",
        401,
        "The token is empty.",
    )
    assert (forged.code, forged.status) == ("bad_signature", 403)
    copy = pickle.loads(pickle.dumps(forged))
    assert (type(copy), copy.code, copy.detail) == (TokenError, forged.code, forged.detail)


def test_episode_key_format() -> None:
    assert episode_key("ep7", 0) == "ep7-a0"
    assert episode_key("run:1.x", 1_000_000) == "run:1.x-a1000000"
    assert parse_token(mint("HS256", att=3), now=NOW).key == "ep7-a3"


def test_new_nonce_is_urlsafe_and_fresh() -> None:
    nonces = {new_nonce() for _ in range(100)}
    assert len(nonces) == 100
    urlsafe = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert all(len(nonce) == 22 and set(nonce) <= urlsafe for nonce in nonces)


@pytest.mark.parametrize("alg", ALGS)
def test_generated_keys_and_pem_round_trip(alg: str) -> None:
    key = SigningKey.generate(alg)
    assert key.alg == alg
    pem = key.public_pem()
    if alg == "HS256":
        assert pem is None
        return
    assert pem is not None and pem.startswith(b"-----BEGIN PUBLIC KEY-----")
    assert TokenVerifier.from_public_pem(pem).alg == alg
    assert TokenVerifier.from_config(alg, pem).alg == alg


@pytest.mark.parametrize(
    "private_key",
    [ed25519.Ed25519PrivateKey.generate(), ec.generate_private_key(ec.SECP256R1())],
    ids=["EdDSA", "ES256"],
)
def test_signing_key_from_private_pem_signs_for_its_public_key(
    private_key: ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey,
) -> None:
    pem = private_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    key = SigningKey.from_private_pem(pem)
    token = mint_token(ep="e", att=0, nonce="n", iat=0, key=key)
    verifier = TokenVerifier.from_public_pem(pem_of(private_key.public_key()))
    assert parse_token(token, now=NOW, verifier=verifier).alg == key.alg == verifier.alg


def unsupported_private_keys() -> list[tuple[str, bytes, str]]:
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    p384 = ec.generate_private_key(ec.SECP384R1())
    ed448_key = ed448.Ed448PrivateKey.generate()
    return [
        ("rsa", rsa_key.private_bytes(*_PKCS8), "RSAPrivateKey keys are not supported"),
        ("p384", p384.private_bytes(*_PKCS8), "an EC key on secp384r1 is not supported"),
        ("ed448", ed448_key.private_bytes(*_PKCS8), "Ed448PrivateKey keys are not supported"),
        (
            "encrypted",
            ed25519.Ed25519PrivateKey.generate().private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.BestAvailableEncryption(b"pw"),
            ),
            "not an unencrypted PEM private key",
        ),
        ("garbage", b"not a key", "not an unencrypted PEM private key"),
    ]


_PKCS8 = (
    serialization.Encoding.PEM,
    serialization.PrivateFormat.PKCS8,
    serialization.NoEncryption(),
)
UNSUPPORTED = unsupported_private_keys()


@pytest.mark.parametrize(
    ("pem", "message"), [c[1:] for c in UNSUPPORTED], ids=[c[0] for c in UNSUPPORTED]
)
def test_unsupported_private_keys_are_refused(pem: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SigningKey.from_private_pem(pem)


@pytest.mark.parametrize(
    ("pem", "message"), [c[1:] for c in UNSUPPORTED[:3]], ids=[c[0] for c in UNSUPPORTED[:3]]
)
def test_unsupported_public_keys_are_refused(pem: bytes, message: str) -> None:
    private_key = serialization.load_pem_private_key(pem, password=None)
    public_pem = private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    with pytest.raises(ValueError, match=message.replace("Private", "Public")):
        TokenVerifier.from_public_pem(public_pem)


def test_from_public_pem_refuses_garbage_and_private_keys() -> None:
    with pytest.raises(ValueError, match=r"^not a PEM public key"):
        TokenVerifier.from_public_pem(
            b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"
        )
    private_pem = ed25519.Ed25519PrivateKey.generate().private_bytes(*_PKCS8)
    with pytest.raises(ValueError, match=r"^not a PEM public key"):
        TokenVerifier.from_public_pem(private_pem)


def test_from_config_checks_alg_against_key_material() -> None:
    ed_pem, es_pem = KEYS["EdDSA"].public_pem(), KEYS["ES256"].public_pem()
    assert ed_pem is not None and es_pem is not None
    assert TokenVerifier.from_config("HS256", SECRET).alg == "HS256"
    with pytest.raises(ValueError, match=r"^alg is ES256 but the PEM key is for EdDSA$"):
        TokenVerifier.from_config("ES256", ed_pem)
    with pytest.raises(ValueError, match=r"^alg is EdDSA but the PEM key is for ES256$"):
        TokenVerifier.from_config("EdDSA", es_pem)
    with pytest.raises(ValueError, match=r"^alg must be one of HS256, EdDSA, ES256, not 'RS256'$"):
        TokenVerifier.from_config("RS256", es_pem)
    with pytest.raises(ValueError, match=r"^alg must be one of HS256, EdDSA, ES256, not 'none'$"):
        TokenVerifier.from_config("none", b"")
    with pytest.raises(ValueError, match=r"^an HS256 secret must be at least 32 bytes"):
        TokenVerifier.from_config("HS256", b"short")


def test_hs256_secret_rules() -> None:
    with pytest.raises(ValueError, match=r"at least 32 bytes \(RFC 7518 §3.2\), not 31$"):
        SigningKey.hs256(b"x" * 31)
    with pytest.raises(ValueError, match=r"not 0$"):
        TokenVerifier.hs256(b"")
    with pytest.raises(TypeError, match=r"^an HS256 secret must be bytes, not str$"):
        TokenVerifier.hs256(cast(bytes, "x" * 32))
    assert SigningKey.hs256(b"x" * 32).verifier().alg == "HS256"


def test_generate_refuses_unknown_alg() -> None:
    with pytest.raises(ValueError, match=r"^alg must be one of HS256, EdDSA, ES256, not 'RS256'$"):
        SigningKey.generate("RS256")


def test_reprs_never_show_key_material() -> None:
    assert repr(SigningKey.hs256(SECRET)) == "SigningKey(alg='HS256')"
    assert repr(HS256_VERIFIER) == "TokenVerifier(alg='HS256')"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"nonce": ""}, "^nonce must be 1 to 256 characters long, not 0$"),
        ({"nonce": "n" * 257}, "^nonce must be 1 to 256 characters long, not 257$"),
        ({"nonce": 5}, "^nonce must be a string, not an integer$"),
        ({"iat": True}, "^iat must be an integer, not a boolean$"),
        ({"iat": 1.0}, "^iat must be an integer, not a number with a fraction or exponent$"),
        ({"exp": 1.5}, "^exp must be an integer, not a number with a fraction or exponent$"),
        ({"exp": False}, "^exp must be an integer, not a boolean$"),
        ({"kid": 5}, "^kid must be a string, not an integer$"),
    ],
)
def test_mint_refuses_claims_the_parser_would_refuse(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        mint("HS256", **changes)


# --- the cache of tokens seen before ------------------------------------------------------


def test_a_cached_token_names_the_same_key_as_a_parse() -> None:
    cache = TokenCache(independent_verifier("HS256"))
    token = mint("HS256", exp=int(NOW) + 60)
    first = cache.key(token, NOW)
    assert first == cache.key(token, NOW + 1) == parse_token(token, now=NOW).key == "ep7-a2"
    assert len(cache) == 1


def test_a_token_differing_only_in_its_signature_is_never_a_cache_hit() -> None:
    cache = TokenCache(independent_verifier("HS256"))
    token = mint("HS256")
    cache.key(token, NOW)
    head, _, signature = token.rpartition(".")
    # The signature's first character: its last one carries padding bits only in part.
    forged = f"{head}.{'A' if signature[0] != 'A' else 'B'}{signature[1:]}"
    with pytest.raises(TokenError) as caught:
        cache.key(forged, NOW)
    assert caught.value.code == "bad_signature"
    assert len(cache) == 1  # a refused token is not kept


def test_a_cached_token_that_expired_is_refused_with_the_reason() -> None:
    cache = TokenCache(None)
    token = mint("HS256", exp=int(NOW) + 10)
    cache.key(token, NOW)
    with pytest.raises(TokenError) as caught:
        cache.key(token, NOW + 10)
    assert caught.value.code == "invalid_token"
    assert "expired" in caught.value.detail
    assert len(cache) == 0


def test_the_cache_keeps_at_most_its_bound_dropping_the_oldest() -> None:
    cache = TokenCache(None, max_entries=3)
    tokens = [
        mint_token(ep=f"ep{i}", att=0, nonce=new_nonce(), key=KEYS["HS256"], iat=1)
        for i in range(5)
    ]
    for token in tokens:
        cache.key(token, NOW)
    assert len(cache) == 3
    assert cache.key(tokens[0], NOW) == "ep0-a0"  # parsed again, and kept again
    assert len(cache) == 3


def test_the_cache_holds_at_most_its_bytes_of_token_text_dropping_the_oldest() -> None:
    # Unverified, any well-formed token is kept: up to 4 KiB each, the count bound
    # alone would let hostile ones pin 64 MiB.
    tokens = [
        mint_token(ep=f"ep{i}", att=0, nonce="n" * 256, key=KEYS["HS256"], iat=1) for i in range(6)
    ]
    size = len(tokens[0])
    assert all(len(token) == size for token in tokens)
    cache = TokenCache(None, max_bytes=3 * size + 10)
    for token in tokens:
        cache.key(token, NOW)
    assert len(cache) == 3  # the last three: 3 * size fits, a fourth would not
    assert cache.key(tokens[5], NOW) == "ep5-a0"
    assert len(cache) == 3
    assert cache.key(tokens[0], NOW) == "ep0-a0"  # parsed again, kept, the oldest dropped
    assert len(cache) == 3
