"""`dilococtl watch`: a Textual dashboard over the store (app factory: dilococtl.tui.app.make_app)."""
