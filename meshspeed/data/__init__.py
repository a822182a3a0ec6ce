"""Tokens: where they come from (corpus), `meshspeed data prepare` (prepare), the layout-independent
batch loader (loader) and tokenizers. Imports only comm/."""
