"""Pipeline schedules within a module and across the module graph."""
