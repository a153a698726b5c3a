"""The invoice workflow's own rules, as data and deterministic code: what an invoice says its
total is (a parser, never the model), and who approves it (the approval policy). The model
proposes; the guards in ``workflow.py`` hold its proposal to these before anything is written.

Invariant: pure functions of their arguments; the same text always reads the same amount.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

#: The largest amount the decision schema allows (12 digits, 2 of them decimals).
MAX_AMOUNT = Decimal("9999999999.99")


# --- who approves: the approval policy --------------------------------------------------


@dataclass(frozen=True)
class ApprovalRule:
    """Invoices of ``category`` ("*": any) above ``above`` (None: any amount) go to ``approver``."""

    approver: str
    category: str = "*"
    above: Decimal | None = None

    def matches(self, category: str, amount: Decimal) -> bool:
        return self.category in ("*", category) and (self.above is None or amount > self.above)


@dataclass(frozen=True)
class ApprovalPolicy:
    """Ordered rules; the first that matches names the approver. Its categories are the ones
    the workflow knows: a decision naming another is refused."""

    rules: tuple[ApprovalRule, ...]
    categories: tuple[str, ...]

    def approver_for(self, *, category: str, amount: Decimal) -> str:
        rule = next((r for r in self.rules if r.matches(category, amount)), None)
        if rule is None:
            raise LookupError(f"the approval policy names no approver for {category} {amount}")
        return rule.approver

    def as_text(self) -> str:
        """The policy in words, for the model's prompt."""
        parts = []
        for rule in self.rules:
            what = "everything else" if rule.category == "*" and rule.above is None else ""
            if rule.category != "*":
                what = f"{rule.category}"
            if rule.above is not None:
                what = f"{what + ' ' if what else ''}amounts above {rule.above}".strip()
                what += ", whatever the category" if rule.category == "*" else ""
            parts.append(f"{rule.approver} for {what}")
        return "; then ".join(parts)


APPROVAL_POLICY = ApprovalPolicy(
    rules=(
        ApprovalRule("cfo@example.com", above=Decimal("10000")),
        ApprovalRule("it-lead@example.com", category="hardware"),
        ApprovalRule("travel-desk@example.com", category="travel"),
        ApprovalRule("finance@example.com"),
    ),
    categories=("office_supplies", "software", "hardware", "travel", "services", "other"),
)


def approver_for(*, category: str, amount: Decimal) -> str:
    """The approver ``APPROVAL_POLICY`` assigns (shared by the rules provider, the prompt and the guard)."""
    return APPROVAL_POLICY.approver_for(category=category, amount=amount)


# --- what the invoice says: amount and currency -----------------------------------------

CURRENCY_CODES = frozenset({"EUR", "USD", "GBP", "JPY", "CHF", "CAD", "AUD", "SEK", "NOK", "DKK", "PLN", "CZK"})
CURRENCY_SYMBOLS = {"€": "EUR", "$": "USD", "£": "GBP", "¥": "JPY"}
DEFAULT_CURRENCY = "EUR"

# Dates look like amounts ("05.03.2024" → 5.03); they are blanked out before amounts are read.
_DATE_RE = re.compile(r"(?<![0-9])[0-9]{1,4}[./-][0-9]{1,2}[./-][0-9]{1,4}(?![0-9])")
# A number: grouped thousands ("1,840.00", "1.840,00", "12'500") or plain ("1840", "3,50").
_NUMBER_RE = re.compile(
    r"(?<![0-9A-Za-z.,])(?:[0-9]{1,3}(?:[,.'\u00a0\u202f][0-9]{3})+(?:[.,][0-9]{1,2})?|[0-9]+(?:[.,][0-9]{1,2})?)(?![0-9])"
)
_CODE_OR_SYMBOL = r"(?:\b([A-Za-z]{3})\b|([€$£¥]))"
_MARKER_BEFORE_RE = re.compile(_CODE_OR_SYMBOL + r"[ \u00a0]?$")
_MARKER_AFTER_RE = re.compile(r"^[ \u00a0]?" + _CODE_OR_SYMBOL)
_ANY_MARKER_RE = re.compile(_CODE_OR_SYMBOL)
_TOTAL_RE = re.compile(r"\b(?:total|amount|sum|due|betrag|montant)\b[^0-9\n]{0,20}$", re.IGNORECASE)


def _currency_of(match: re.Match[str] | None) -> str | None:
    if match is None:
        return None
    code, symbol = match.group(1), match.group(2)
    if symbol:
        return CURRENCY_SYMBOLS[symbol]
    return code.upper() if code and code.upper() in CURRENCY_CODES else None


def _parse_number(token: str) -> Decimal:
    """``"1,840.00"``, ``"1.840,00"``, ``"1840"``, ``"3,50"`` → a Decimal with 2 places. The last
    separator is the decimal point when 1 or 2 digits follow it; every other one groups."""
    s = re.sub(r"['\u00a0\u202f]", "", token)
    last = max(s.rfind("."), s.rfind(","))
    if last >= 0 and len(s) - last - 1 in (1, 2):
        whole, fraction = s[:last], s[last + 1 :]
    else:
        whole, fraction = s, "0"
    whole = re.sub(r"[.,]", "", whole) or "0"
    return Decimal(f"{whole}.{fraction}").quantize(Decimal("0.01"))


def find_amount(text: str) -> tuple[Decimal, str | None] | None:
    """The first money-looking number and the currency written next to it, if any.

    Money-looking, in order of preference: a number next to a currency code or symbol; a
    number after "total"/"amount"/"due"; a number with decimals or grouped thousands. Plain
    integers (quantities, years, invoice numbers) are not amounts on their own."""
    scrubbed = _DATE_RE.sub(lambda m: " " * len(m.group(0)), text)
    candidates: list[tuple[int, int, Decimal, str | None]] = []
    for match in _NUMBER_RE.finditer(scrubbed):
        try:
            value = _parse_number(match.group(0))
        except InvalidOperation:  # pragma: no cover - the pattern admits only digits and separators
            continue
        if value > MAX_AMOUNT:
            continue
        start, end = match.span()
        currency = _currency_of(_MARKER_BEFORE_RE.search(scrubbed, max(0, start - 5), start)) or _currency_of(
            _MARKER_AFTER_RE.match(scrubbed[end : end + 5])
        )
        if currency:
            rank = 0
        elif _TOTAL_RE.search(scrubbed, max(0, start - 40), start):
            rank = 1
        elif not match.group(0).isdigit():
            rank = 2
        else:
            continue
        candidates.append((rank, start, value, currency))
    if not candidates:
        return None
    _, _, value, currency = min(candidates, key=lambda c: (c[0], c[1]))
    return value, currency


def first_currency(text: str) -> str | None:
    for match in _ANY_MARKER_RE.finditer(text):
        currency = _currency_of(match)
        if currency:
            return currency
    return None


@dataclass(frozen=True)
class Total:
    amount: Decimal
    currency: str
    explicit: bool  # the currency is written in the text (not the default)


def invoice_total(text: str) -> Total | None:
    """The invoice's total as the text states it (``EUR 1,840.00``, ``1.840,00 €``,
    ``USD 12,000``), or None when no amount can be read. The currency is the one written next
    to the amount, else the first one in the text, else ``DEFAULT_CURRENCY``."""
    found = find_amount(text)
    if found is None:
        return None
    amount, currency = found
    explicit = currency or first_currency(text)
    return Total(amount=amount, currency=explicit or DEFAULT_CURRENCY, explicit=explicit is not None)
