class SandboxRouter:
    """The simulated systems live in their own database (alias ``sandbox``), never the
    engine's: "the receiver committed but the worker never heard" must be real."""

    app_label = "sandbox"

    def db_for_read(self, model, **hints):
        return "sandbox" if model._meta.app_label == self.app_label else None

    db_for_write = db_for_read

    def allow_relation(self, obj1, obj2, **hints):
        if self.app_label in (obj1._meta.app_label, obj2._meta.app_label):
            return obj1._meta.app_label == obj2._meta.app_label
        return None

    def allow_migrate(self, db, app_label, model_name=None, **hints):
        if app_label == self.app_label:
            return db == "sandbox"
        return db != "sandbox"
