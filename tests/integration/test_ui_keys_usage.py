"""The Keys and Usage pages against a real server and agent (sim engine), read as a
browser reads them (httpx, forms posted urlencoded, cookies kept), with the official
`openai` client using the key the page made."""

from __future__ import annotations

import csv
import html
import io
import re
from datetime import UTC, datetime, timedelta

import httpx
import openai
import pytest

from tests.integration.cluster import wait_for
from tests.integration.conftest import SIM_SMALL, one_node_cluster

# OWASP's minimum argon2id: the cheapest the server accepts, so logins are quick.
FAST_AUTH = {"argon2_memory_kib": 19 * 1024, "argon2_time_cost": 2,
             "argon2_parallelism": 1, "hash_slots": 2}
PASSWORDS = {"root": "root's long password", "alice": "alice's long password",
             "bob": "bob's long password"}
PAGE_MAX = 100_000  # bytes: every page stays well under it


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    with one_node_cluster(tmp_path_factory.mktemp("ui-keys"), request, [SIM_SMALL],
                          {"auth": FAST_AUTH}) as c:
        for name, password in PASSWORDS.items():
            made = c.admin("POST", "/api/users", json={
                "username": name, "password": password,
                "role": "admin" if name == "root" else "user"})
            assert made.status_code == 201, made.text
        yield c


def csrf_of(page: httpx.Response) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)


def alerts(page: httpx.Response) -> list[str]:
    """What the page says is wrong, as a person reads it."""
    return [html.unescape(re.sub(r"<[^>]+>", "", m))
            for m in re.findall(r'role="alert"[^>]*>(.*?)</p>', page.text, re.S)]


def flash(page: httpx.Response) -> str:
    found = re.search(r'class="flash" role="status">([^<]+)<', page.text)
    return html.unescape(found.group(1)) if found else ""


@pytest.fixture(scope="module")
def browsers(cluster):
    """A signed-in browser per account, through the login form."""
    made = {}
    for name, password in PASSWORDS.items():
        browser = httpx.Client(base_url=cluster.base_url, timeout=10)
        form = browser.get("/ui/login")
        signed_in = browser.post("/ui/login", data={
            "csrf": csrf_of(form), "username": name, "password": password, "next": "/ui/keys"})
        assert signed_in.status_code == 303, alerts(signed_in)
        made[name] = browser
    yield made
    for browser in made.values():
        browser.close()


def get(browser: httpx.Client, path: str, status: int = 200) -> httpx.Response:
    page = browser.get(path, follow_redirects=True)
    assert page.status_code == status, (path, page.status_code, alerts(page))
    assert len(page.content) < PAGE_MAX, (path, len(page.content))
    return page


def make_key(browser: httpx.Client, name: str, **fields) -> tuple[str, str]:
    """Make a key on the Keys page: (its prefix, the secret read from the answer page)."""
    form = get(browser, "/ui/keys")
    answer = browser.post("/ui/keys", data={"csrf": csrf_of(form), "name": name, **fields})
    assert answer.status_code == 200, alerts(answer)
    assert answer.headers["cache-control"] == "no-store", "a secret is never cached"
    shown = re.search(r'<div class="secret">\s*<output id="new-key"[^>]*>(llmgw_\w+)</output>',
                      answer.text)
    assert shown, answer.text
    assert "shown this once" in answer.text
    prefix = re.search(r"<dt>Prefix</dt><dd><code>(\w+)</code>", answer.text).group(1)
    assert shown.group(1).startswith(prefix)
    return prefix, shown.group(1)


def chat(cluster, key: str):
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=key, max_retries=0)
    return client.chat.completions.create(
        model="sim-small", messages=[{"role": "user", "content": "hello from the page"}])


def csv_rows(browser: httpx.Client, query: str = "") -> list[dict[str, str]]:
    answer = browser.get(f"/ui/usage.csv{query}")
    assert answer.status_code == 200, alerts(answer)
    return list(csv.DictReader(io.StringIO(answer.text)))


def test_a_user_makes_a_key_uses_it_sees_its_usage_and_revokes_it(cluster, browsers):
    alice = browsers["alice"]
    prefix, key = make_key(alice, "notebook", models="sim-small")
    answer = chat(cluster, key)
    assert answer.choices[0].message.content

    listed = get(alice, "/ui/keys")
    assert prefix in listed.text and "notebook" in listed.text
    assert key not in listed.text, "the secret is shown once, on the page that made it"
    assert key not in get(alice, f"/ui/keys/{prefix}").text

    # Usage is flushed to the store about once a second.
    today = datetime.now(UTC).date().isoformat()

    def recorded():
        rows = [r for r in csv_rows(alice) if r["key"] == f"notebook ({prefix})"]
        return rows if rows and int(rows[0]["requests"]) >= 1 else None

    rows = wait_for(recorded, 10, "the request in the usage CSV")
    assert rows == [{"day": today, "key": f"notebook ({prefix})", "owner": "alice",
                     "model": "sim-small", "requests": "1",
                     "prompt_tokens": str(answer.usage.prompt_tokens),
                     "completion_tokens": str(answer.usage.completion_tokens)}]
    usage = get(alice, "/ui/usage?days=7")
    tokens = f"{answer.usage.prompt_tokens + answer.usage.completion_tokens:,}"
    by_key = re.search(rf'<a href="/ui/keys/{prefix}">notebook</a>.*?</tr>', usage.text, re.S)
    assert by_key and tokens in by_key.group(0), usage.text
    assert '<svg class="chart"' in usage.text and "sim-small" in usage.text
    key_page = get(alice, f"/ui/keys/{prefix}")
    assert "This key was not used" not in key_page.text and "sim-small" in key_page.text

    # Revoking asks for a word of confirmation first.
    unconfirmed = alice.post(f"/ui/keys/{prefix}/revoke", data={"csrf": csrf_of(key_page)})
    assert unconfirmed.status_code == 400
    assert "tick the box" in alerts(unconfirmed)[0]
    assert chat(cluster, key).choices, "an unconfirmed revoke changes nothing"
    revoked = alice.post(f"/ui/keys/{prefix}/revoke",
                         data={"csrf": csrf_of(key_page), "confirm": "yes"})
    assert revoked.status_code == 303 and revoked.headers["location"] == "/ui/keys"
    after = get(alice, "/ui/keys")
    assert f"Key notebook ({prefix}) is revoked" in flash(after)
    assert re.search(rf"{prefix}</code></td>.*?state-revoked", after.text, re.S)
    with pytest.raises(openai.AuthenticationError) as refused:
        chat(cluster, key)
    assert "revoked" in str(refused.value)


def test_a_form_without_its_csrf_token_is_refused(cluster, browsers):
    alice = browsers["alice"]
    before = {k["prefix"] for k in cluster.admin("GET", "/api/keys").json()}
    forged = alice.post("/ui/keys", data={"name": "forged"})
    assert forged.status_code == 403
    assert "CSRF token" in alerts(forged)[0]
    wrong = alice.post("/ui/keys", data={"name": "forged", "csrf": csrf_of(
        get(browsers["bob"], "/ui/keys"))})  # bob's token in alice's browser
    assert wrong.status_code == 403
    assert {k["prefix"] for k in cluster.admin("GET", "/api/keys").json()} == before

    prefix, _ = make_key(alice, "kept")
    no_token = alice.post(f"/ui/keys/{prefix}/revoke", data={"confirm": "yes"})
    assert no_token.status_code == 403
    assert "state-active" in get(alice, f"/ui/keys/{prefix}").text


def test_a_user_sees_only_their_own_keys(cluster, browsers):
    alice, bob = browsers["alice"], browsers["bob"]
    prefix, key = make_key(alice, "alice-only")
    chat(cluster, key)

    bobs = get(bob, "/ui/keys")
    assert prefix not in bobs.text and "alice-only" not in bobs.text
    assert "Owner" not in bobs.text, "a user is not shown an owner column"
    # Someone else's key is "not found", to look at or to revoke.
    assert "you have no key" in alerts(get(bob, f"/ui/keys/{prefix}", status=404))[0]
    tried = bob.post(f"/ui/keys/{prefix}/revoke", data={"csrf": csrf_of(bobs), "confirm": "yes"})
    assert tried.status_code == 404
    assert chat(cluster, key).choices, "bob's attempt left alice's key working"
    # Limits are an admin's to set.
    limits = bob.post(f"/ui/keys/{prefix}/limits", data={"csrf": csrf_of(bobs), "rpm": "1"})
    assert limits.status_code == 403

    # Once alice's usage is recorded, it is still only hers.
    wait_for(lambda: any(r["key"] == f"alice-only ({prefix})" for r in csv_rows(alice)), 10,
             "alice's request in her usage CSV")
    assert prefix not in get(bob, "/ui/usage").text
    assert not [r for r in csv_rows(bob) if prefix in r["key"]]
    assert prefix in get(browsers["root"], "/ui/usage").text, "an admin sees every key's use"


def test_an_admin_sees_every_key_sets_limits_and_revokes_any(cluster, browsers):
    alice, root = browsers["alice"], browsers["root"]
    prefix, key = make_key(alice, "for-the-admin")
    everyone = get(root, "/ui/keys")
    row = re.search(r"for-the-admin</a></td>.*?</tr>", everyone.text, re.S).group(0)
    assert "<td>alice</td>" in row, "an admin sees each key's owner"

    page = get(root, f"/ui/keys/{prefix}")
    bad = root.post(f"/ui/keys/{prefix}/limits", data={
        "csrf": csrf_of(page), "rpm": "lots", "tpm": "", "tokens_per_day": "",
        "tokens_per_month": ""})
    assert bad.status_code == 400
    assert any("Requests per minute must be a whole number" in a for a in alerts(bad))
    saved = root.post(f"/ui/keys/{prefix}/limits", data={
        "csrf": csrf_of(page), "rpm": "1", "tpm": "", "tokens_per_day": "1,000,000",
        "tokens_per_month": ""})
    assert saved.status_code == 303
    assert "1 requests/min, 1,000,000 tokens/day" in flash(get(root, saved.headers["location"]))
    limits = cluster.admin("GET", f"/api/keys/{prefix}/usage").json()["limits"]
    assert {u["limit"]: u["value"] for u in limits} == {
        "rpm": 1, "tpm": None, "tokens_per_day": 1_000_000, "tokens_per_month": None}

    # An admin makes a key for someone else, with limits from the start.
    nobody = root.post("/ui/keys", data={"csrf": csrf_of(page), "name": "x", "owner": "nobody"})
    assert nobody.status_code == 400 and "no user named 'nobody'" in alerts(nobody)[1]
    bobs_prefix, _ = make_key(root, "for-bob", owner="bob", tokens_per_month="5000000")
    bobs = get(browsers["bob"], f"/ui/keys/{bobs_prefix}")
    assert re.search(r"Tokens per month \(UTC\)</td><td class=\"num\">5,000,000", bobs.text)

    revoked = root.post(f"/ui/keys/{prefix}/revoke",
                        data={"csrf": csrf_of(page), "confirm": "yes"})
    assert revoked.status_code == 303
    with pytest.raises(openai.AuthenticationError):
        chat(cluster, key)
    assert "state-revoked" in get(alice, f"/ui/keys/{prefix}").text


def test_the_usage_period_is_bounded_and_named_in_the_download(browsers):
    alice = browsers["alice"]
    today = datetime.now(UTC).date()
    backwards = get(alice, f"/ui/usage?since={today}&until={today - timedelta(days=1)}", 400)
    assert "is after until" in alerts(backwards)[0]
    too_long = get(alice, f"/ui/usage?since={today - timedelta(days=400)}&until={today}", 400)
    assert "ask for 366 days or fewer" in alerts(too_long)[0]
    assert "must be a date like" in alerts(get(alice, "/ui/usage?since=yesterday", 400))[0]

    since = today - timedelta(days=89)
    quarter = get(alice, f"/ui/usage?since={since}&until={today}")
    assert f"From {since} to {today} (90 days)" in quarter.text
    download = alice.get(f"/ui/usage.csv?since={since}&until={today}")
    assert download.headers["content-type"].startswith("text/csv")
    assert download.headers["content-disposition"] == (
        f"attachment; filename=llmgw-usage-{since}-{today}.csv")
    assert download.text.splitlines()[0] == (
        "day,key,owner,model,requests,prompt_tokens,completion_tokens")


def test_the_pages_need_a_session(cluster):
    with httpx.Client(base_url=cluster.base_url) as stranger:
        for path in ("/ui/keys", "/ui/usage", "/ui/usage.csv"):
            answer = stranger.get(path)
            assert answer.status_code == 303
            assert answer.headers["location"].startswith("/ui/login?next=")
