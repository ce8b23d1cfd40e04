"""The workers a router knows: membership and their load reports, health, circuit breakers,
outliers, the speeds it measures on what it relays, and the KV events it follows."""
