"""The small shop the computer-use agent works in: search, product pages, a cart, a checkout
form and an order confirmation, served by the example itself on 127.0.0.1 (FastAPI).

Plain server-rendered HTML (no JavaScript), so the accessibility tree Chromium builds is the
page's own: links, a search box, buttons, labelled form fields. State (the cart, the orders)
lives in the app instance.
"""

from __future__ import annotations

import html
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse


@dataclass(frozen=True)
class Product:
    id: int
    name: str
    price: float
    blurb: str


CATALOGUE = (
    Product(1, "Blue ceramic mug", 12.50, "A 350 ml stoneware mug, dishwasher safe."),
    Product(2, "Red ceramic mug", 12.50, "The blue mug's sibling, glazed red."),
    Product(3, "Steel water bottle", 24.00, "Keeps drinks cold for 24 hours; 750 ml."),
    Product(4, "Linen notebook", 9.90, "A5, 120 dotted pages, lies flat."),
    Product(5, "Fountain pen", 35.00, "Steel nib, converter included."),
    Product(6, "Desk lamp", 48.00, "Warm LED, three brightness steps."),
    Product(7, "Coffee beans 1 kg", 21.00, "Medium roast, whole beans from Huila."),
    Product(8, "Travel mug", 18.00, "Leak-proof lid, fits car cup holders."),
)


@dataclass
class ShopState:
    cart: dict[int, int] = field(default_factory=dict)  # product id -> quantity
    orders: list[dict[str, str]] = field(default_factory=list)


def _page(title: str, body: str, cart_count: int) -> HTMLResponse:
    return HTMLResponse(
        f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{title} - Tiny Shop</title>
<style>body{{font-family:sans-serif;margin:24px;max-width:720px}}nav a{{margin-right:16px}}
li{{margin:8px 0}}label{{display:block;margin-top:8px}}.filler{{height:900px}}</style></head>
<body><nav aria-label="Main"><a href="/">Home</a><a href="/cart">Cart ({cart_count})</a>
<a href="/checkout">Checkout</a></nav><main><h1>{title}</h1>{body}</main></body></html>"""
    )


_SEARCH_FORM = """<form action="/search" method="get" role="search">
<label for="q">Search products</label><input id="q" name="q" type="search">
<button type="submit">Search</button></form>"""


async def _form(request: Request) -> dict[str, str]:
    """An ``application/x-www-form-urlencoded`` body (what the shop's forms post)."""
    fields = parse_qs((await request.body()).decode("utf-8", "replace"))
    return {k: v[0] for k, v in fields.items()}


def create_shop(state: ShopState | None = None) -> FastAPI:
    """The shop app: ``/``, ``/search?q=``, ``/product/{id}``, ``/cart``, ``/checkout``."""
    state = state or ShopState()
    app = FastAPI(title="Tiny Shop", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.shop = state

    def count() -> int:
        return sum(state.cart.values())

    @app.get("/", response_class=HTMLResponse)
    def home() -> HTMLResponse:
        picks = "".join(
            f'<li><a href="/product/{p.id}">{html.escape(p.name)}</a></li>' for p in CATALOGUE[:3]
        )
        body = f"{_SEARCH_FORM}<h2>Popular</h2><ul>{picks}</ul>"
        body += '<div class="filler"></div><p>Free shipping on orders over 50 euros.</p>'
        return _page("Welcome", body, count())

    @app.get("/search", response_class=HTMLResponse)
    def search(q: str = "") -> HTMLResponse:
        words = [w for w in q.lower().split() if w]
        hits = [p for p in CATALOGUE if words and all(w in p.name.lower() for w in words)]
        items = "".join(
            f'<li><a href="/product/{p.id}">{html.escape(p.name)}</a> {p.price:.2f} EUR</li>'
            for p in hits
        )
        result = f"<ul>{items}</ul>" if hits else "<p>No products found.</p>"
        return _page(f"Results for {html.escape(q)}", _SEARCH_FORM + result, count())

    @app.get("/product/{pid}", response_class=HTMLResponse)
    def product(pid: int) -> HTMLResponse:
        p = next((p for p in CATALOGUE if p.id == pid), None)
        if p is None:
            return _page("Not found", "<p>No such product.</p>", count())
        body = (
            f"<p>{html.escape(p.blurb)}</p><p>Price: {p.price:.2f} EUR</p>"
            f'<form action="/cart/add" method="post"><input type="hidden" name="pid" '
            f'value="{p.id}"><button type="submit">Add to cart</button></form>'
        )
        return _page(html.escape(p.name), body, count())

    @app.post("/cart/add")
    async def add(request: Request) -> RedirectResponse:
        pid = (await _form(request)).get("pid", "")
        pid = int(pid) if pid.isdigit() else -1
        if any(p.id == pid for p in CATALOGUE):
            state.cart[pid] = state.cart.get(pid, 0) + 1
        return RedirectResponse("/cart", status_code=303)

    @app.get("/cart", response_class=HTMLResponse)
    def cart() -> HTMLResponse:
        rows = [(p, state.cart[p.id]) for p in CATALOGUE if p.id in state.cart]
        if not rows:
            return _page("Your cart", "<p>Your cart is empty.</p>", count())
        items = "".join(
            f"<li>{html.escape(p.name)} x {n}: {p.price * n:.2f} EUR</li>" for p, n in rows
        )
        total = sum(p.price * n for p, n in rows)
        body = (
            f'<ul>{items}</ul><p>Total: {total:.2f} EUR</p><a href="/checkout">Go to checkout</a>'
        )
        return _page("Your cart", body, count())

    @app.get("/checkout", response_class=HTMLResponse)
    def checkout() -> HTMLResponse:
        body = """<form action="/checkout" method="post">
<label for="name">Full name</label><input id="name" name="name" autocomplete="off">
<label for="email">Email</label><input id="email" name="email" type="email" autocomplete="off">
<label for="address">Street address</label><input id="address" name="address" autocomplete="off">
<button type="submit">Place order</button></form>"""
        return _page("Checkout", body, count())

    @app.post("/checkout", response_class=HTMLResponse)
    async def place(request: Request) -> HTMLResponse:
        form = await _form(request)
        name, email, address = (form.get(k, "").strip() for k in ("name", "email", "address"))
        if not (name and email and address and state.cart):
            missing = "your cart is empty" if not state.cart else "every field is required"
            return _page("Checkout", f"<p>Cannot place the order: {missing}.</p>", count())
        number = f"A{1000 + len(state.orders)}"
        state.orders.append(
            {"number": number, "name": name, "email": email, "address": address}
            | {"items": ",".join(f"{pid}x{n}" for pid, n in sorted(state.cart.items()))}
        )
        state.cart.clear()
        body = f"<p>Thank you, {html.escape(name)}. Your order number is {number}.</p>"
        return _page("Order placed", body, count())

    return app


class ShopServer:
    """The shop served by uvicorn in a daemon thread on 127.0.0.1 (port 0: a free one)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.state = ShopState()
        config = uvicorn.Config(create_shop(self.state), host=host, port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.host = host

    def __enter__(self) -> ShopServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the shop server failed to start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.host}:{port}"
