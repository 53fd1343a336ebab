"""A real headless Chromium driven by Playwright: the computer-use agent's screen and hands.

Debian's ``chromium`` package (``/usr/bin/chromium``), launched by Playwright's Python API with
``executable_path`` (Playwright's own browser download is never used). Playwright's sync API
must stay on the thread that started it, so every call runs on one dedicated worker thread.

Each observation is the page's accessibility tree as text (Playwright's ARIA snapshot: roles
and accessible names, what the agent refers to in its actions) and a JPEG screenshot.
"""

from __future__ import annotations

import base64
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

CHROMIUM = os.environ.get("AGENTKV_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
INSTALL_HINT = "apt-get install -y chromium   (as root; Debian's package, /usr/bin/chromium)"
ACTION_TIMEOUT_MS = 3000


class BrowserMissing(RuntimeError):
    """Chromium or Playwright is not installed."""


def find_chromium() -> str:
    """The Chromium executable, or :class:`BrowserMissing` saying how to install it."""
    path = CHROMIUM if os.path.isfile(CHROMIUM) else shutil.which("chromium")
    if not path:
        raise BrowserMissing(f"Chromium not found at {CHROMIUM}; install it with: {INSTALL_HINT}")
    return path


@dataclass(frozen=True)
class Observation:
    """What the agent sees after a step."""

    url: str
    title: str
    tree: str  # ARIA snapshot (YAML-like text)
    screenshot: bytes  # JPEG
    note: str = ""  # what the last action did, or why it failed

    def text(self) -> str:
        head = f"{self.note}\n" if self.note else ""
        return f"{head}URL: {self.url}\nTitle: {self.title}\nAccessibility tree:\n{self.tree}"

    def content(self) -> list[dict[str, Any]]:
        """OpenAI content parts: the accessibility tree (text), then the screenshot (image)."""
        data = base64.b64encode(self.screenshot).decode()
        return [
            {"type": "text", "text": self.text()},
            {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{data}"}},
        ]


class Browser:
    """One headless Chromium page. ``with Browser() as b: b.goto(url); b.click("link", "Home")``.

    Actions never raise for a missing element: the observation's ``note`` says what happened,
    so the agent can recover, as it would on a real screen.
    """

    def __init__(
        self, viewport: tuple[int, int] = (800, 600), jpeg_quality: int = 50, executable: str = ""
    ):
        self.viewport = viewport
        self.jpeg_quality = jpeg_quality
        self.executable = executable
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chromium")
        self._pw: Any = None
        self._browser: Any = None
        self._page: Any = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Browser:
        self._call(self._start)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._call(self._stop)
        finally:
            self._pool.shutdown(wait=True)

    def _call(self, fn, *args: Any) -> Any:
        return self._pool.submit(fn, *args).result()

    def _start(self) -> None:
        executable = self.executable or find_chromium()
        try:
            from playwright.sync_api import sync_playwright
        except ImportError as e:
            raise BrowserMissing("Playwright is not installed: pip install playwright") from e
        self._pw = sync_playwright().start()
        self._browser = self._pw.chromium.launch(
            executable_path=executable, headless=True, args=list(CHROMIUM_FLAGS)
        )
        w, h = self.viewport
        self._page = self._browser.new_page(viewport={"width": w, "height": h})
        self._page.set_default_timeout(ACTION_TIMEOUT_MS)

    def _stop(self) -> None:
        if self._browser is not None:
            self._browser.close()
        if self._pw is not None:
            self._pw.stop()

    @property
    def version(self) -> str:
        return self._call(lambda: self._browser.version)

    # -------------------------------------------------------------------- actions
    def goto(self, url: str) -> Observation:
        return self._call(self._act, f"opened {url}", lambda p: p.goto(url))

    def click(self, role: str, name: str) -> Observation:
        return self._call(
            self._act,
            f"clicked {role} {name!r}",
            lambda p: p.get_by_role(role, name=name, exact=True).first.click(),
        )

    def type(self, role: str, name: str, text: str, submit: bool = False) -> Observation:
        def do(p: Any) -> None:
            box = p.get_by_role(role, name=name, exact=True).first
            box.fill(text)
            if submit:
                box.press("Enter")

        what = f"typed {text!r} into {role} {name!r}" + (" and pressed Enter" if submit else "")
        return self._call(self._act, what, do)

    def scroll(self, direction: str = "down") -> Observation:
        dy = self.viewport[1] * (1 if direction == "down" else -1)
        return self._call(self._act, f"scrolled {direction}", lambda p: p.mouse.wheel(0, dy))

    def go_back(self) -> Observation:
        return self._call(self._act, "went back", lambda p: p.go_back())

    def observe(self) -> Observation:
        return self._call(self._observe, "")

    def _act(self, what: str, action) -> Observation:
        try:
            action(self._page)
            self._page.wait_for_load_state()
            note = f"Done: {what}."
        except Exception as e:  # Playwright's TimeoutError / Error: the element was not there
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            note = f"Failed: {what}: {first}"
        return self._observe(note)

    def _observe(self, note: str) -> Observation:
        page = self._page
        page.wait_for_timeout(50)  # let the scroll position settle before the screenshot
        return Observation(
            url=page.url,
            title=page.title(),
            tree=page.locator("body").aria_snapshot(),
            screenshot=page.screenshot(type="jpeg", quality=self.jpeg_quality),
            note=note,
        )
