"""Hostile input and the Content-Security-Policy in a real browser (Debian's Chromium driven
by Playwright, as tests/browser/test_console_browser.py): the console works under the policy
without a single violation, and text planted in every field it shows (tests/support/hostile.py)
is displayed as text and never runs — with the policy bypassed too, so that escaping alone is
what is tested, not the policy hiding a hole."""

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group

from recovery.engine.transitions import run_start
from recovery.models import AuditEvent, RunState, WorkflowRun
from sandbox.models import Fault
from tests.browser.conftest import needs_chromium
from tests.support import hostile, receivers, workflows
from tests.support.engine import drive

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", "sandbox"]),
    needs_chromium,
    pytest.mark.storage_agnostic,  # markup, scripts, policy, layout: CI runs it on PostgreSQL only
]

# Every violation of the policy, and every sign that planted text ran, recorded from the first
# byte of each document on.
WATCH = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__csp.push(`${e.violatedDirective} ${e.blockedURI} ${e.sample || ""}`);
});
"""


class Watched:
    """A logged-in page whose policy violations and console errors are collected."""

    def __init__(self, new_context, live_server, username: str, password: str, *, bypass_csp: bool = False):
        self.base = live_server.url
        self.context = new_context(viewport={"width": 1360, "height": 900}, bypass_csp=bypass_csp)
        self.context.add_init_script(WATCH)
        self.page = self.context.new_page()
        self.console: list[str] = []
        self.page.on("console", lambda m: self.console.append(m.text) if m.type in ("error", "warning") else None)
        self.page.on("dialog", lambda d: d.accept())  # hx-confirm: window.confirm
        self.policies: dict[str, str | None] = {}
        self.page.on("response", self._record_policy)
        self.goto("/login/")
        self.page.fill("input[name=username]", username)
        self.page.fill("input[name=password]", password)
        self.page.click("button[type=submit]")
        self.page.wait_for_load_state()

    def _record_policy(self, response) -> None:
        if response.request.resource_type == "document" or response.request.headers.get("hx-request"):
            self.policies[response.url] = response.headers.get("content-security-policy")

    def goto(self, path: str) -> None:
        response = self.page.goto(self.base + path)
        assert response.status in (200, 400), (path, response.status)

    def violations(self) -> list[str]:
        return self.page.evaluate("window.__csp") + [m for m in self.console if "Content Security Policy" in m]

    def ran(self):
        return self.page.evaluate("window.__xss")

    def provoke(self) -> None:
        """Fire what an injected attribute would listen to: pointer, focus and animation events on
        every element, and a real hover over each table row and link. First the parts a page
        fetches once loaded (the runs list's counts, aria-busy until then) have arrived: a row
        replaced under the pointer cannot be hovered."""
        self.page.wait_for_function("() => !document.querySelector('[aria-busy=true]')")
        self.page.evaluate(
            """() => { for (const el of document.querySelectorAll("body *")) {
                 for (const type of ["mouseover", "mouseenter", "focus", "animationstart"]) {
                   el.dispatchEvent(new Event(type, {bubbles: true}));
                 } }
               document.querySelectorAll("details").forEach((d) => { d.open = true; }); }"""
        )
        for locator in self.page.locator("main tr, main a").all()[:60]:
            if locator.is_visible():
                locator.hover(force=True, timeout=2000)

    def text(self) -> str:
        return self.page.locator("body").inner_text()


def supervisor(username="boss"):
    user = get_user_model().objects.create_user(username, password="pw")
    user.groups.add(Group.objects.get_or_create(name="supervisor")[0])
    return user


def test_the_console_and_the_admin_work_under_the_policy_without_a_violation(
    new_context, live_server, clock, monkeypatch
):
    POLICY_START = "default-src 'self'; script-src 'self'; style-src 'self'"
    receivers.arm("message", "commit_then_drop")
    monkeypatch.setattr(workflows.notify, "lookup_fn", lambda ctx: (_ for _ in ()).throw(RuntimeError("down")))
    unknown = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "csp-1"})[0], clock)
    monkeypatch.undo()
    receivers.arm("task", "forbidden")
    failed = drive(run_start(workflow="test_orders", data={"tenant": "t", "order_id": "csp-2"})[0], clock)
    supervisor()
    w = Watched(new_context, live_server, "boss", "pw")
    page = w.page
    assert page.url == f"{w.base}/"
    for path in ["/", "/?stuck=any", "/dashboard", "/demo", f"/runs/{failed.workflow_id}"]:
        w.goto(path)
    # htmx at work: an action with a reason, swapped in place; a confirmed terminate.
    w.goto(f"/runs/{unknown.workflow_id}")
    form = page.locator("form.action", has=page.locator('[data-action="reconcile:notify"]'))
    form.locator("input[name=reason]").fill("messenger is back")
    form.locator("button").click()
    page.wait_for_selector("text=reconcile (notify) recorded")
    w.goto(f"/runs/{failed.workflow_id}")
    page.locator("details.more-actions > summary").click()  # retrying its step is the recommended action
    form = page.locator("form.action", has=page.locator('[data-action="terminate"]'))
    form.locator("input[name=reason]").fill("bad batch")
    form.locator("button").click()
    page.wait_for_selector("text=terminate recorded")
    assert WorkflowRun.objects.get(pk=failed.pk).state == RunState.TERMINATED
    # an error swapped into #flash by htmx (a stale version: 409)
    w.goto(f"/runs/{unknown.workflow_id}")
    page.locator("input[name=version]").first.evaluate("(el) => { el.value = 'stale'; }")
    form = page.locator("form.action").first
    form.locator("input[name=reason]").fill("again")
    form.locator("button").click()
    page.wait_for_selector("#flash .flash.error")
    # the demo page's form, the bulk form
    w.goto("/demo")
    page.get_by_role("button", name="Arm").click()
    page.wait_for_selector("text=armed")
    w.goto("/")
    page.get_by_role("button", name="Select every run on this page").click()  # an htmx swap of the table
    page.wait_for_function("() => [...document.querySelectorAll('input[name=run]')].every((b) => b.checked)")
    assert w.violations() == []
    assert htmx_loaded(page)
    assert w.policies and all(p and p.startswith(POLICY_START) for p in w.policies.values()), w.policies

    get_user_model().objects.create_superuser("root", password="root-pw")
    admin = Watched(new_context, live_server, "root", "root-pw")
    for path in ["/admin/", "/admin/recovery/workflowrun/", f"/admin/recovery/workflowrun/{failed.pk}/change/"]:
        admin.goto(path)
        assert admin.page.locator("#site-name").is_visible()
        assert admin.violations() == [], path
    # Users are read-only in the admin (createoperator changes them): its user pages, under the policy.
    root = get_user_model().objects.get(username="root")
    for path in ["/admin/auth/user/", f"/admin/auth/user/{root.pk}/change/", "/admin/recovery/accountevent/"]:
        admin.goto(path)
        assert admin.page.locator("#site-name").is_visible()
        assert admin.violations() == [], path
    assert admin.page.goto(admin.base + "/admin/auth/user/add/").status == 403
    assert all(p and "unsafe" not in p for p in admin.policies.values()), admin.policies


def htmx_loaded(page) -> bool:
    return page.evaluate("typeof window.htmx === 'object' && htmx.config.allowEval === false")


@pytest.mark.parametrize("bypass_csp", [True, False], ids=["escaping-alone", "under-the-policy"])
def test_hostile_text_is_shown_as_text_and_never_runs(new_context, live_server, clock, monkeypatch, bypass_csp):
    planted = hostile.plant(clock, monkeypatch)
    fault_mode = "<svg onload=window.__xss=1>"  # the column holds 32 characters
    Fault.objects.using("sandbox").create(service="tasks", operation="create", mode=fault_mode)
    w = Watched(new_context, live_server, planted.actor, "pw", bypass_csp=bypass_csp)
    page = w.page
    assert planted.actor in page.locator("header .who").inner_text()  # logged in under the hostile name

    def check(path: str | None, must_show: list[str]) -> None:
        if path is not None:
            w.goto(path)
        w.provoke()
        assert w.ran() is None, f"planted script ran on {path or page.url}"
        shown = w.text()
        for value in must_show:
            assert value in shown, f"{value!r} is not shown as text on {path or page.url}"

    resolved = f"/runs/{planted.resolved.workflow_id}"
    check(resolved, [v for k, v in planted.on_run_page.items() if k != "incident"] + [planted.actor])
    assert hostile.tagged(hostile.ALL, "incident") in page.locator(".incident").inner_text()
    check(f"/runs/{planted.hostile_id.workflow_id}", [planted.hostile_id.workflow_id, planted.hostile_id.business_key])
    check("/", list(planted.on_list_page.values()))
    page.locator("form.filters input[name=q]").fill(hostile.ALL)
    page.locator("form.filters input[name=key]").fill(hostile.IMG)
    page.get_by_role("button", name="Filter").click()
    page.wait_for_load_state()
    # The empty result says what was searched, the hostile text as text.
    check(None, [f"No run has “{hostile.ALL}” in its workflow id", f"whose business key begins {hostile.IMG}"])
    # echoed back as values, intact: in the filter form and in the bulk form's hidden fields
    assert page.locator("form.filters input[name=q]").input_value() == hostile.ALL
    assert page.locator("form.filters input[name=key]").input_value() == hostile.IMG
    assert page.locator("form.bulk input[type=hidden][name=q]").input_value() == hostile.ALL
    check("/dashboard", ["Runs by state"])
    check("/demo", [f"tasks create: {fault_mode} × 1"])

    # The demo form tampered with: the refusal echoes the hostile mode on the page.
    page.locator("select[name=mode]").evaluate(
        "(el, v) => { el.options[0].value = v; el.selectedIndex = 0; }", hostile.IMG
    )
    page.get_by_role("button", name="Arm").click()
    page.wait_for_load_state()
    check(None, [f"unknown mode {hostile.IMG!r}"])

    # Bulk: the hostile run and a hostile id that matches no run, with a hostile reason.
    w.goto("/")
    page.evaluate(
        """([id, missing]) => {
             const box = [...document.querySelectorAll("input[name=run]")].find((el) => el.value === id);
             box.checked = true;
             const forged = box.cloneNode(); forged.value = missing; forged.checked = true; box.after(forged);
           }""",
        [planted.hostile_id.workflow_id, "nope:" + hostile.ALL],
    )
    page.locator("select[name=action]").select_option("retry")
    page.locator("input[name=reason][placeholder^='reason (recorded']").fill(hostile.ALL)
    page.get_by_role("button", name="Check first (dry run)").click()
    page.wait_for_selector("text=Would be left untouched")
    check(None, ["nope:" + hostile.ALL, planted.hostile_id.workflow_id])
    assert AuditEvent.objects.filter(action="retry", reason=hostile.ALL).count() == 0
    page.locator("[data-action=confirm-bulk]").click()
    page.wait_for_selector("text=1 run changed")
    check(None, [planted.hostile_id.workflow_id])
    assert AuditEvent.objects.filter(action="retry", reason=hostile.ALL).count() == 1

    # Flash messages swapped in by htmx: an unknown action and an unknown step, both echoed.
    w.goto(f"/runs/{planted.hostile_id.workflow_id}")
    events = AuditEvent.objects.filter(run=planted.hostile_id).count()
    for action, step, echoed in [
        (hostile.ALL, None, f"unknown action {hostile.ALL!r}"),
        ("reconcile", hostile.SVG, f"has no step {hostile.SVG!r}"),
    ]:
        form = page.locator("form.action").first
        form.locator("input[name=action]").evaluate("(el, v) => { el.value = v; }", action)
        if step is not None:
            form.locator("input[name=step]").evaluate("(el, v) => { el.value = v; }", step)
        form.locator("input[name=reason]").fill("why")
        form.locator("button").click()
        page.wait_for_function("(t) => document.querySelector('#flash').innerText.includes(t)", arg=echoed)
        check(None, [echoed])
    assert AuditEvent.objects.filter(run=planted.hostile_id).count() == events

    if not bypass_csp:
        assert w.violations() == []  # nothing planted even tried to run against the policy
