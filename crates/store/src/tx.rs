//! The transaction handle: a state change, its event and its outbox rows commit together.

use sqlx::{Any, AnyConnection, Transaction};

use crate::{
    events, sandboxes, teams, templates, Backend, Build, BuildStatus, Event, NewBuild, NewEvent,
    NewTeam, NewTemplate, Result, SandboxRecord, SandboxState, Team, Template,
};

/// An open transaction. Dropped without [`StoreTx::commit`], it rolls back.
pub struct StoreTx {
    tx: Transaction<'static, Any>,
    backend: Backend,
}

impl StoreTx {
    pub(crate) fn new(tx: Transaction<'static, Any>, backend: Backend) -> StoreTx {
        StoreTx { tx, backend }
    }

    pub(crate) fn connection(&mut self) -> &mut AnyConnection {
        &mut self.tx
    }

    /// The database behind the transaction.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Makes everything done through this transaction durable, at once.
    pub async fn commit(self) -> Result<()> {
        self.tx.commit().await?;
        Ok(())
    }

    /// Discards everything done through this transaction.
    pub async fn rollback(self) -> Result<()> {
        self.tx.rollback().await?;
        Ok(())
    }

    pub async fn create_team(&mut self, new: &NewTeam) -> Result<Team> {
        teams::create_team(&mut self.tx, new).await
    }

    pub async fn create_template(&mut self, new: &NewTemplate) -> Result<Template> {
        templates::create_template(&mut self.tx, new).await
    }

    pub async fn add_alias(&mut self, template_id: &str, alias: &str) -> Result<()> {
        templates::add_alias(&mut self.tx, template_id, alias).await
    }

    pub async fn create_build(&mut self, new: &NewBuild) -> Result<Build> {
        templates::create_build(&mut self.tx, new).await
    }

    pub async fn set_build_status(&mut self, build_id: &str, status: BuildStatus) -> Result<bool> {
        templates::set_build_status(&mut self.tx, build_id, status).await
    }

    pub async fn set_tag(&mut self, template_id: &str, tag: &str, build_id: &str) -> Result<()> {
        templates::set_tag(&mut self.tx, template_id, tag, build_id).await
    }

    pub async fn remove_tag(&mut self, template_id: &str, tag: &str) -> Result<bool> {
        templates::remove_tag(&mut self.tx, template_id, tag).await
    }

    /// Reads a live template inside the transaction.
    pub async fn template(&mut self, template_id: &str) -> Result<Option<Template>> {
        templates::template_by_id(&mut self.tx, template_id).await
    }

    /// Reads a build inside the transaction.
    pub async fn build(&mut self, build_id: &str) -> Result<Option<Build>> {
        templates::build_by_id(&mut self.tx, build_id).await
    }

    pub async fn tagged_builds(&mut self, template_id: &str) -> Result<Vec<(String, Build)>> {
        templates::tagged_builds(&mut self.tx, template_id).await
    }

    pub async fn delete_template(&mut self, template_id: &str) -> Result<bool> {
        templates::delete_template(&mut self.tx, template_id).await
    }

    /// Reads a sandbox inside the transaction (read-modify-write under the KV lock).
    pub async fn sandbox(&mut self, sandbox_id: &str) -> Result<Option<SandboxRecord>> {
        sandboxes::by_id(&mut self.tx, sandbox_id).await
    }

    pub async fn insert_sandbox(&mut self, record: &SandboxRecord) -> Result<()> {
        sandboxes::insert(&mut self.tx, record).await
    }

    /// Overwrites the record (its `execution_id` may change, e.g. on resume) if it still is
    /// `expected_execution_id` and no larger `fence` (the KV lock's token) has written it.
    /// `false`: a stale operation, nothing written.
    pub async fn update_sandbox(
        &mut self,
        record: &SandboxRecord,
        expected_execution_id: &str,
        fence: i64,
    ) -> Result<bool> {
        sandboxes::update(&mut self.tx, record, expected_execution_id, fence).await
    }

    /// Moves the state only from one of `from` (any if empty), same conditions as
    /// [`StoreTx::update_sandbox`].
    pub async fn set_sandbox_state(
        &mut self,
        sandbox_id: &str,
        execution_id: &str,
        from: &[SandboxState],
        to: SandboxState,
        fence: i64,
    ) -> Result<bool> {
        sandboxes::set_state(&mut self.tx, sandbox_id, execution_id, from, to, fence).await
    }

    /// Removes a killed sandbox's record (its events stay).
    pub async fn delete_sandbox(
        &mut self,
        sandbox_id: &str,
        execution_id: &str,
        fence: i64,
    ) -> Result<bool> {
        sandboxes::delete(&mut self.tx, sandbox_id, execution_id, fence).await
    }

    /// Appends an event and queues it for every enabled webhook of the team subscribed to its
    /// type.
    pub async fn append_event(&mut self, new: &NewEvent) -> Result<Event> {
        events::append(&mut self.tx, new).await
    }
}
