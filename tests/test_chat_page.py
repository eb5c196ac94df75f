"""The chat page of `lmforge serve` (GET /) in a real headless Chromium, driven by selenium.

Two real servers: the tiny chat model of ``serve_helpers`` (it answers "Say hello" with a fixed greeting
and "Open main.go" with a read_file tool call when tools are listed) behind an API key, and an untrained
deep model with a long context and no key, whose greedy replies go on for thousands of tokens (for the
stop button). Debian's ``chromium`` and ``chromium-driver`` packages are required (``.ci/run`` installs
them); without them every test here fails saying so. When a test fails, a screenshot, the page's HTML
and the browser's console are saved under pytest's temporary directory and their paths printed with
the failure.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from lmforge.models.gpt import GPT, GPTConfig
from lmforge.serve.page import ASSETS, STATIC
from lmforge.tokenizer import Tokenizer, train_tokenizer

from .serve_helpers import CORPUS, HELLO, TOOLS, Server, train_chat_model

KEY = "sk-chat-page-test"
HANG = 120  # seconds: every wait here only guards against a hang; none is a timing assertion
LONG = 16_000  # max tokens asked of the long-winded model, which would take a minute or more to write them
PACKAGES = "apt-get install -y chromium chromium-driver"


# ---- servers ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    server = Server(train_chat_model(tmp_path_factory.mktemp("chat_page")), "--api-key", KEY)
    yield server
    server.stop()


def long_winded_checkpoint(out: Path) -> Path:
    """An untrained model that does not say eos when greedy (checked: all LONG tokens) and takes a few
    milliseconds per token (32 thin layers): a reply of LONG tokens runs for a minute or more (over three
    on a busy machine), so a reply whose row is gone seconds after the stop button was ended by it."""
    tokenizer = Tokenizer.load(train_tokenizer(CORPUS, vocab_size=300, out_dir=out / "tokenizer", show_progress=False))
    torch.manual_seed(0)
    model = GPT(GPTConfig(flavor="llama", vocab_size=tokenizer.vocab_size, n_positions=LONG + 384, n_embd=32,
                          n_layer=32, n_head=2))
    ckpt = model.save_pretrained(out / "ckpt")
    tokenizer.save(ckpt)
    return ckpt


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    server = Server(long_winded_checkpoint(tmp_path_factory.mktemp("chat_page_long")), "--max-batch-size", "1")
    yield server
    server.stop()


# ---- the browser, and what it shows when a test fails -------------------------------------------------

class FailureRecords:
    """A pytest plugin: when a test of this file fails, saves the browser's screenshot, page source and
    console log, and names the files in the failure report."""

    def __init__(self, driver, folder: Path):
        self.driver, self.folder = driver, folder

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if report.failed and call.when == "call" and Path(item.path) == Path(__file__):
            self.folder.mkdir(parents=True, exist_ok=True)
            stem = self.folder / re.sub(r"[^\w.-]+", "_", item.name)
            saved = []
            for suffix, save in ((".png", lambda p: self.driver.save_screenshot(str(p))),
                                 (".html", lambda p: p.write_text(self.driver.page_source, encoding="utf-8")),
                                 (".console.txt", lambda p: p.write_text(
                                     "\n".join(str(e) for e in self.driver.get_log("browser")), encoding="utf-8"))):
                try:
                    save(stem.with_suffix(suffix))
                    saved.append(str(stem.with_suffix(suffix)))
                except Exception as e:  # noqa: BLE001 - a dead browser: say so, keep the test's own failure
                    saved.append(f"{stem.with_suffix(suffix)}: not saved ({type(e).__name__}: {e})")
            report.sections.append(("chat page at the failure", "\n".join(saved)))
        return report


def browser_paths() -> tuple[str, str]:
    """Chromium and its driver, or a failure naming the Debian packages that are missing."""
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    missing = [package for package, path in (("chromium", chromium), ("chromium-driver", chromedriver)) if not path]
    if missing:
        pytest.fail(f"the chat page tests need a real browser: install the Debian package(s) {' and '.join(missing)} "
                    f"({PACKAGES}; .ci/run does this)", pytrace=False)
    return chromium, chromedriver


def test_chromium_and_its_driver_are_installed():
    """Fails (not skips) without them, naming the packages; the tests that need them error the same way."""
    browser_paths()


@pytest.fixture(scope="module")
def browser(request, tmp_path_factory):
    chromium, chromedriver = browser_paths()
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the chat page tests need selenium: pip install -e '.[test]'", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium  # with the driver's path too, selenium downloads nothing
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}", "--no-first-run",
                "--disable-extensions", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-default-apps"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    records = FailureRecords(driver, tmp_path_factory.getbasetemp() / "chat-page-failures")
    request.config.pluginmanager.register(records, "lmforge-chat-page-failures")
    yield driver
    request.config.pluginmanager.unregister(records)
    driver.quit()


class Page:
    """The chat page in the browser, as a person uses it (typing, clicking) where it matters."""

    def __init__(self, driver):
        from selenium.common.exceptions import StaleElementReferenceException
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys
        from selenium.webdriver.support.ui import WebDriverWait

        self.driver, self.By, self.Keys = driver, By, Keys
        self.within = lambda seconds: WebDriverWait(driver, seconds, poll_frequency=0.05,
                                                    ignored_exceptions=(StaleElementReferenceException,))
        self.wait = self.within(HANG)

    def __call__(self, element_id: str):
        return self.driver.find_element(self.By.ID, element_id)

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def open(self, server: Server, key: str | None = KEY, forget_key: bool = False) -> None:
        """Load the page with its default settings; enter ``key`` if the page asks for one."""
        self.driver.get(server.base + "/")
        if forget_key:
            self.js("sessionStorage.clear()")
            self.driver.get(server.base + "/")
        self.js("document.getElementById('settings').open = true")
        self("reset-settings").click()
        self.wait.until(lambda _: self("key-form").is_displayed() or self("input").is_enabled())
        if self("key-form").is_displayed() and key:
            self.enter_key(key)
            self.wait.until(lambda _: self("input").is_enabled())

    def enter_key(self, key: str) -> None:
        self("key-input").clear()
        self("key-input").send_keys(key + self.Keys.ENTER)

    def settings(self, **values: str) -> None:
        """Fills settings fields (``max_tokens=`` is the field max-tokens) as typing would."""
        for name, value in values.items():
            self.js("const f = document.getElementById(arguments[0]); f.value = arguments[1];"
                    "f.dispatchEvent(new Event('input', {bubbles: true}));", name.replace("_", "-"), value)

    def messages(self, role: str = "") -> list:
        return self.driver.find_elements(self.By.CSS_SELECTOR, f"#messages .msg{'.' + role if role else ''}")

    def send(self, text: str) -> None:
        """Types the message and presses Enter."""
        self("input").send_keys(text + self.Keys.ENTER)

    def reply(self, text: str):
        """Sends ``text`` and waits for the reply to end: the assistant's article (an error fails the test)."""
        replies, errors = len(self.messages("assistant")), len(self.messages("error"))
        self.send(text)
        self.wait.until(lambda _: len(self.messages("error")) > errors or (
            len(self.messages("assistant")) > replies
            and self.messages("assistant")[-1].get_attribute("data-state") != "streaming"))
        assert len(self.messages("error")) == errors, f"the reply failed: {self.messages('error')[-1].text}"
        return self.messages("assistant")[-1]

    def error_after(self, action) -> str:
        """Runs ``action`` and returns the text of the error it added to the conversation."""
        before = len(self.messages("error"))
        action()
        self.wait.until(lambda _: len(self.messages("error")) > before)
        return self.messages("error")[-1].text

    def last_request(self) -> dict | None:
        return self.js("return window.lmforgeChat.lastRequest")

    def script_errors(self) -> list[str]:
        """The console's errors other than the HTTP errors the tests provoke on purpose."""
        return [e["message"] for e in self.driver.get_log("browser")
                if e["level"] == "SEVERE" and "Failed to load resource" not in e["message"]]


@pytest.fixture
def page(browser):
    return Page(browser)


def content(article) -> str:
    return article.find_element("css selector", ".content").get_attribute("textContent")


# ---- the tests ------------------------------------------------------------------------------------------

def test_the_page_and_its_files_are_served_without_the_key_and_nothing_else(chat_server):
    base = chat_server.base
    page = httpx.get(base + "/", timeout=HANG)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]  # nothing loaded from elsewhere
    assert 'src="static/chat.js"' in page.text and 'href="static/chat.css"' in page.text
    for name, kind in (("chat.js", "text/javascript"), ("chat.css", "text/css")):
        r = httpx.get(f"{base}/static/{name}", timeout=HANG)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert r.content == (STATIC / name).read_bytes()
    assert set(ASSETS) | {"index.html"} == {p.name for p in STATIC.iterdir()}  # every shipped file is served
    for path in ("/static/index.html", "/static/nothing.js", "/static/..%2fpage.py", "/static/%2e%2e%2fapp.py",
                 "/static/../page.py", "/static//etc/passwd", "/static/%2e%2e/%2e%2e/serve/app.py"):
        r = httpx.get(base + path, timeout=HANG)
        assert r.status_code == 404 and "error" in r.json(), path
    for f in STATIC.iterdir():  # works offline: nothing refers to another server
        text = f.read_text(encoding="utf-8")
        assert not re.search(r"(https?|wss?|ftp):|=\s*[\"']//|url\(|@import", text), f.name
    assert httpx.get(base + "/v1/models", timeout=HANG).status_code == 401  # the API itself still needs the key


def test_the_page_asks_for_the_api_key_refuses_a_wrong_one_readably_then_chats(page, chat_server):
    page.open(chat_server, key=None, forget_key=True)
    assert page("key-form").is_displayed() and "needs an API key" in page("key-reason").text
    assert not page("input").is_enabled() and not page("send").is_enabled()
    page.enter_key("sk-wrong")
    page.wait.until(lambda _: page("key-error").is_displayed())
    assert "refused this key" in page("key-error").text and "Incorrect API key" in page("key-error").text
    assert page("key-form").is_displayed() and not page("input").is_enabled()  # asked again
    page.enter_key(KEY)
    page.wait.until(lambda _: page("input").is_enabled())
    assert not page("key-form").is_displayed() and page("change-key").is_displayed()
    assert page("model").text == "tiny · context 256 tokens"
    page.settings(temperature="0")
    reply = page.reply("Say hello")
    assert content(reply) == HELLO and reply.get_attribute("data-state") == "done"
    assert page.script_errors() == []


def test_a_reply_streams_into_the_conversation_which_is_sent_back_each_turn(page, chat_server):
    page.open(chat_server)
    page.settings(temperature="0")
    page("input").send_keys("one", page.Keys.SHIFT, page.Keys.ENTER, page.Keys.SHIFT, "two")
    assert page("input").get_attribute("value") == "one\ntwo" and page.messages() == []  # Shift+Enter: a new line
    page("input").clear()
    # Every change the page makes to an assistant reply's text, seen from outside the page's code.
    page.js("""window.replyChanges = 0;
        new MutationObserver(records => { for (const r of records)
            if (r.addedNodes.length && r.target.matches && r.target.matches('.msg.assistant .content'))
                window.replyChanges += 1; })
        .observe(document.getElementById('messages'), {childList: true, subtree: true});""")
    reply = page.reply("Say hello")
    assert content(reply) == HELLO and reply.get_attribute("data-finish") == "stop"
    chunks = int(reply.get_attribute("data-chunks"))
    assert chunks > 1 and page.js("return window.replyChanges") == chunks  # shown piece by piece as it came
    assert re.fullmatch(r"\d+ tokens", reply.find_element("css selector", ".meta").text)
    assert [m.get_attribute("data-role") for m in page.messages()] == ["user", "assistant"]

    page.reply("Say hello")
    assert page.last_request()["messages"] == [{"role": "user", "content": "Say hello"},
                                               {"role": "assistant", "content": HELLO},
                                               {"role": "user", "content": "Say hello"}]
    assert page.last_request()["stream"] is True and page.last_request()["model"] == "tiny"
    page("new-chat").click()
    assert page.messages() == []
    assert content(page.reply("Say hello")) == HELLO
    assert page.last_request()["messages"] == [{"role": "user", "content": "Say hello"}]
    assert page.script_errors() == []


def test_stop_ends_a_reply_mid_stream_keeps_it_and_cancels_it_on_the_server(page, long_server):
    page.open(long_server, key=None)
    assert not page("key-form").is_displayed() and not page("change-key").is_displayed()  # no key, none asked
    page.settings(temperature="0", max_tokens=str(LONG))
    page.send("Tell me everything")
    page.wait.until(lambda _: page.messages("assistant"))
    reply = page.messages("assistant")[0]
    page.wait.until(lambda _: int(reply.get_attribute("data-chunks")) >= 3
                    or reply.get_attribute("data-state") != "streaming")
    assert reply.get_attribute("data-state") == "streaming", "the reply ended before the test could stop it"
    assert content(reply) and page("stop").is_enabled() and not page("send").is_enabled()  # text while it streams
    page("stop").click()
    page.wait.until(lambda _: reply.get_attribute("data-state") != "streaming")
    assert reply.get_attribute("data-state") == "stopped" and "stopped by you" in reply.text
    kept, chunks = content(reply), int(reply.get_attribute("data-chunks"))
    assert kept and chunks < LONG and not page("stop").is_enabled() and page("send").is_enabled()
    # The abort reached the engine: the row leaves at its next step (milliseconds), where writing all LONG
    # tokens would take a minute or more (over three on a busy machine). The 30 s limit between the two is
    # the one bound in this file that is not only a guard against a hang.
    health = long_server.base + "/health"
    page.within(30).until(lambda _: httpx.get(health, timeout=HANG).json()["running"] == 0,
                          "the stopped reply still runs on the server")
    assert content(reply) == kept

    page.settings(max_tokens="1")  # the partial reply is part of the conversation
    page.reply("Go on")
    assert page.last_request()["messages"][:2] == [{"role": "user", "content": "Tell me everything"},
                                                   {"role": "assistant", "content": kept}]
    assert page.script_errors() == []


def test_settings_are_sent_and_kept(page, chat_server):
    page.open(chat_server)
    page.settings(temperature="0", max_tokens="3")
    reply = page.reply("Say hello")
    text = content(reply)
    assert text and HELLO.startswith(text) and text != HELLO  # the first 3 tokens of the greeting
    assert int(reply.get_attribute("data-chunks")) <= 3 and reply.get_attribute("data-finish") == "length"
    assert reply.find_element("css selector", ".meta").text == "cut at the max tokens limit · 3 tokens"
    sent = page.last_request()
    assert sent["temperature"] == 0 and sent["max_tokens"] == 3 and "tools" not in sent
    page.settings(system="You are terse.")
    page.reply("Say hello")
    assert page.last_request()["messages"][0] == {"role": "system", "content": "You are terse."}

    page.driver.refresh()  # kept in this browser
    page.wait.until(lambda _: page("input").is_enabled())
    fields = ("temperature", "max-tokens", "system")
    assert [page(f).get_attribute("value") for f in fields] == ["0", "3", "You are terse."]
    page.js("document.getElementById('settings').open = true")
    page("reset-settings").click()
    assert [page(f).get_attribute("value") for f in fields] == ["0.7", "", ""]


def test_tool_calls_are_shown_as_such_and_sent_back_with_their_results(page, chat_server):
    page.open(chat_server)
    page.settings(temperature="0", tools=json.dumps(TOOLS, indent=2))
    reply = page.reply("Open main.go")
    assert reply.get_attribute("data-finish") == "tool_calls" and content(reply) == ""
    (call,) = reply.find_elements("css selector", ".tool-call")
    assert call.find_element("css selector", ".tool-name").text == "read_file"
    assert call.find_element("css selector", ".tool-args").text == json.dumps({"path": "main.go"}, indent=2)
    call_id = call.find_element("css selector", ".tool-id").text
    assert call_id.startswith("call_") and page.last_request()["tools"] == TOOLS

    assert page("as-tool-label").is_displayed() and "read_file" in page("as-tool-label").text
    page.settings(tools="", max_tokens="2")  # the tools' description and the result would not fit 256 tokens
    page.reply("package main")  # sent as the call's result
    assert page.messages("tool")[0].text.startswith("Tool result · read_file")
    assert page.last_request()["messages"] == [
        {"role": "user", "content": "Open main.go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "read_file", "arguments": '{"path": "main.go"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "package main"}]
    assert not page("as-tool-label").is_displayed()

    page("new-chat").click()  # without tools, no call: the model was only taught to call one when told of tools
    page.settings(max_tokens="10")
    reply = page.reply("Open main.go")
    assert not reply.find_elements("css selector", ".tool-call") and "tools" not in page.last_request()


def test_errors_are_shown_readably(page, chat_server):
    page.open(chat_server)
    page.settings(temperature="0")
    page.send("Say hello")  # a first request, to see that bad settings send none
    page.wait.until(lambda _: page.messages("assistant") and page.messages("assistant")[-1].get_attribute(
        "data-state") == "done")
    sent = page.last_request()

    page.settings(tools="[{")
    error = page.error_after(lambda: page.send("Say hello"))
    assert "Tools are not valid JSON" in error and "nothing was sent" in error
    assert page("tools").get_attribute("aria-invalid") == "true" and page("settings-error").is_displayed()
    assert page("input").get_attribute("value") == "Say hello"  # kept, to send once the settings are fixed
    page.settings(tools='{"type": "function"}')
    assert "must be a JSON list" in page.error_after(lambda: page.send(page.Keys.ENTER))
    assert page.last_request() == sent
    page.settings(tools="")
    page("input").clear()

    page.settings(temperature="5")  # the server's own 400, as the server words it
    error = page.error_after(lambda: page.send("Say hello"))
    assert "HTTP 400" in error and "'temperature' must be in [0.0, 2.0], got 5" in error
    assert "parameter: temperature" in error
    assert "failed" in page.messages("user")[-1].get_attribute("class")  # not part of the conversation
    assert page("input").get_attribute("value") == "Say hello"
    page("input").clear()

    page.settings(temperature="0", system="word " * 300)  # the system prompt is sent: it does not fit
    error = page.error_after(lambda: page.send("Say hello"))
    assert "HTTP 400" in error and "maximum context length is 256 tokens" in error
    page("input").clear()
    page.settings(system="", max_tokens="100000")
    error = page.error_after(lambda: page.send("Say hello"))
    assert "maximum context length" in error and "max_tokens" in error

    page.settings(max_tokens="")  # after all that, the conversation is still the first exchange, and goes on
    page("input").clear()
    page.reply("Say hello")
    assert [m["role"] for m in page.last_request()["messages"]] == ["user", "assistant", "user"]
    assert page.script_errors() == []


# ---- a reply that fails mid-way ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def failing_server():
    """A stand-in server for the page whose replies fail after their first words: "error" with an error
    event in the stream (as `lmforge serve` reports one once the headers are out), "drop" with a connection
    that closes before [DONE]; any other message gets the reply "fine"."""
    import asyncio
    import threading
    import time

    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from lmforge.serve.page import add_chat_page

    from .serve_helpers import free_port

    app = FastAPI()
    add_chat_page(app)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model", "context_length": 64}]}

    async def chat(request):  # a plain Starlette route: the request comes as it is
        last = (await request.json())["messages"][-1]["content"]

        def event(delta: dict, finish: str | None = None) -> str:
            return "data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                                          "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

        async def body():
            yield event({"role": "assistant", "content": ""})
            if last in ("error", "drop"):
                yield event({"content": "partial words"})
                await asyncio.sleep(0.2)  # shown before it fails
                if last == "error":
                    yield "data: " + json.dumps({"error": {"message": "generation failed: boom", "code": "x"}}) + "\n\n"
                    yield "data: [DONE]\n\n"
                return  # "drop": no [DONE]
            yield event({"content": "fine"})
            yield event({}, "stop")
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    app.router.add_route("/v1/chat/completions", chat, methods=["POST"])

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield type("FakeServer", (), {"base": f"http://127.0.0.1:{port}"})()
    server.should_exit = True
    thread.join(timeout=HANG)


@pytest.mark.parametrize("failure, words", [("error", "generation failed: boom"),
                                            ("drop", "The connection closed before the reply ended")])
def test_a_reply_that_fails_mid_way_stays_visible_but_out_of_the_conversation(page, failing_server, failure, words):
    page.open(failing_server, key=None)
    assert content(page.reply("hello")) == "fine"
    error = page.error_after(lambda: page.send(failure))
    assert words in error
    failed = page.messages("assistant")[-1]
    assert content(failed) == "partial words" and failed.get_attribute("data-state") == "error"
    assert "failed" in failed.get_attribute("class") and "not part of the conversation" in failed.text
    asked = page.messages("user")[-1]
    assert "failed" in asked.get_attribute("class") and "reply failed" in asked.text
    assert page("input").get_attribute("value") == failure  # back in the input box, to send again
    page("input").clear()
    page.reply("again")
    assert page.last_request()["messages"] == [{"role": "user", "content": "hello"},
                                               {"role": "assistant", "content": "fine"},
                                               {"role": "user", "content": "again"}]
    assert page.script_errors() == []
