"""Calibration text for the store's INT4 key channel scales.

Outlier key channels are a property of the model's projections (and RoPE), not of one input,
so a short fixed conversation shaped like agent traffic (instructions, a tool schema, a tool
call, a JSON tool result, prose) measures them once when the engine starts. Deterministic: the
same engine always quantizes the same way, whatever it served before.
"""

from __future__ import annotations

CALIBRATION_MESSAGES = [
    {
        "role": "system",
        "content": (
            "You are a customer support agent for an airline. Follow the policy: verify the "
            "user's identity, confirm every change before you make it, never invent flight "
            "numbers, and transfer to a human agent when a request is outside the policy. "
            "Baggage: economy includes one checked bag; business includes two."
        ),
    },
    {"role": "user", "content": "Hi, I need to move my flight HAT083 from May 16 to May 18."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {
                    "name": "get_reservation_details",
                    "arguments": '{"reservation_id": "4WQ150", "user_id": "sara_doe_496"}',
                },
            }
        ],
    },
    {
        "role": "tool",
        "tool_call_id": "call_0",
        "content": (
            '{"reservation_id": "4WQ150", "origin": "JFK", "destination": "SEA", '
            '"flights": [{"flight_number": "HAT083", "date": "2024-05-16", "price": 712}], '
            '"cabin": "economy", "payment_history": [{"payment_id": "credit_card_7815826", '
            '"amount": 712}], "passengers": [{"first_name": "Sara", "last_name": "Doe"}]}'
        ),
    },
    {
        "role": "assistant",
        "content": (
            "I found reservation 4WQ150: JFK to Seattle on May 16, economy, $712. The May 18 "
            "flight HAT083 costs $689, so you would get $23 back. Shall I make the change?"
        ),
    },
    {"role": "user", "content": "Yes please, and add one checked bag. def f(x): return x * 2"},
]
