"""``/api``: the admin API: cluster status, accounts, sessions and API keys."""

from llmgw.server.admin import accounts, keys, nodes, status

ROUTES = [*status.ROUTES, *accounts.ROUTES, *keys.ROUTES, *nodes.ROUTES]
