"""The operator dashboard: signed session cookies, the sign-in guard, and the static pages."""
