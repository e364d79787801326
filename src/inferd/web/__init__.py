"""What inferd shows in a browser, served alike by `inferd serve` and `inferd router`: the chat page
and the dashboard (static files in `static/`), their colours (`style`, shared with the bench's HTML
reports), and the dashboard's event feed (`feed`). No engine, no torch, no server here: plain data."""
