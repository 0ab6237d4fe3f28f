//! MariaDB relay groups pass the conformance suite's group check: the tables and the renewal
//! procedure `migrate` creates, on the database's clock (moved by shifting the stored times).

mod common;

use std::time::Duration;

use common::{db, Db};
use outbox_conformance_tests::group::GroupHarness;
use outbox_traits::{async_trait, Error, RelayGroupStore};

struct Harness {
    db: Db,
}

#[async_trait]
impl GroupHarness for Harness {
    fn groups(&self) -> &dyn RelayGroupStore {
        &self.db.store
    }

    async fn advance(&self, by: Duration) -> Result<(), Error> {
        let us = i64::try_from(by.as_micros()).map_err(|_| Error::invalid_input("too long"))?;
        let table = self.db.config.table();
        for sql in [
            format!(
                "UPDATE `{table}_group_members` SET \
                 renewed_at = renewed_at - INTERVAL ? MICROSECOND, \
                 lease_until = lease_until - INTERVAL ? MICROSECOND"
            ),
            format!(
                "UPDATE `{table}_group_shards` SET \
                 lease_until = lease_until - INTERVAL ? MICROSECOND"
            ),
        ] {
            let binds = sql.matches('?').count();
            let mut query = sqlx::query(&sql);
            for _ in 0..binds {
                query = query.bind(us);
            }
            query
                .execute(self.db.pool())
                .await
                .map_err(|e| Error::permanent(e.to_string(), None))?;
        }
        Ok(())
    }

    async fn cleanup(&self) -> Result<(), Error> {
        sqlx::raw_sql(&self.db.config.drop_sql())
            .execute(self.db.pool())
            .await
            .map(drop)
            .map_err(|e| Error::permanent(e.to_string(), None))
    }
}

outbox_conformance_tests::group_suite!(optional: db().await.map(|db| Harness { db }));

mod odd_names {
    //! Group names past the limit, at it, and outside ASCII, on the real server.

    use std::time::Duration;

    use outbox_backend_mysql::{MysqlConfig, MysqlStore};
    use outbox_traits::{Error, GroupRenewal, RelayGroupStore, MAX_GROUP_NAME_BYTES};
    use uuid::Uuid;

    use super::common::{db, random_table, Db, URL_VAR};
    use outbox_conformance_tests::env::service_url;

    fn renewal(group: &str, member_name: &str) -> GroupRenewal {
        GroupRenewal {
            group: group.to_owned(),
            member: Uuid::new_v4(),
            member_name: member_name.to_owned(),
            shards: 4,
            lease: Duration::from_secs(30),
        }
    }

    /// Rows of the table's two group tables.
    async fn group_rows(db: &Db) -> (i64, i64) {
        let table = db.config.table();
        let count = |suffix: &str| {
            let sql = format!("SELECT COUNT(*) FROM `{table}_{suffix}`");
            async move {
                sqlx::query_scalar::<_, i64>(&sql)
                    .fetch_one(db.pool())
                    .await
                    .unwrap()
            }
        };
        (count("group_members").await, count("group_shards").await)
    }

    /// A group or member name of several hundred characters is refused with a typed error that
    /// says the limit, before the store writes anything; a name of exactly the limit works.
    #[tokio::test]
    async fn a_name_of_several_hundred_characters_is_refused_before_anything_is_written() {
        let Some(db) = db().await else { return };
        let long = "g".repeat(300);
        for req in [renewal(&long, "m"), renewal("g", &long)] {
            match db.store.renew_group(&req).await {
                Err(Error::InvalidInput(message)) => assert!(
                    message.contains(&MAX_GROUP_NAME_BYTES.to_string()),
                    "{message}"
                ),
                other => panic!("a 300-character name: {other:?}"),
            }
        }
        // Several hundred characters of which each takes several bytes: refused by bytes.
        let wide = "é".repeat(150);
        assert!(matches!(
            db.store.renew_group(&renewal(&wide, "m")).await,
            Err(Error::InvalidInput(_))
        ));
        assert_eq!(group_rows(&db).await, (0, 0), "nothing written");

        let longest = "g".repeat(MAX_GROUP_NAME_BYTES);
        let view = db
            .store
            .renew_group(&renewal(&longest, &longest))
            .await
            .unwrap();
        assert_eq!(view.owned.len(), 4);
        let members = db.store.group_status(&longest).await.unwrap();
        assert_eq!(members.len(), 1);
        assert_eq!(members[0].member_name, longest);
        db.drop().await;
    }

    /// Group and member names outside ASCII (accents, CJK, an emoji: 4 bytes in UTF-8) work, and
    /// names differing in one such character are different groups, even in a database whose
    /// default character set is `latin1`: the renewal procedure's parameters would take that
    /// default and refuse the name ("Incorrect string value") if they did not name theirs.
    #[tokio::test]
    async fn unicode_names_are_distinct_groups_even_in_a_latin1_database() {
        let Some(url) = service_url(URL_VAR) else {
            return;
        };
        let database = format!("latin1_{}", &random_table()[12..]);
        let admin = sqlx::MySqlPool::connect(&url).await.unwrap();
        sqlx::query(&format!(
            "CREATE DATABASE `{database}` CHARACTER SET latin1 COLLATE latin1_swedish_ci"
        ))
        .execute(&admin)
        .await
        .unwrap();
        let config = MysqlConfig::builder()
            .database(database.clone())
            .table("outbox")
            .build()
            .unwrap();
        let store = MysqlStore::connect(&url, config).await.unwrap();
        store.migrate().await.unwrap();

        let groups = ["relais-ü-组-🚀", "relais-u-组-🚀", "relais-ü-组-🚁"];
        let member_name = "hôte-机器:42";
        for group in groups {
            let view = store
                .renew_group(&renewal(group, member_name))
                .await
                .unwrap();
            // Each is a group of its own: its one member takes every shard.
            assert_eq!(view.members, 1, "{group}");
            assert_eq!(view.owned.len(), 4, "{group}");
        }
        for group in groups {
            let members = store.group_status(group).await.unwrap();
            assert_eq!(members.len(), 1, "{group}: {members:?}");
            assert_eq!(members[0].member_name, member_name);
            assert_eq!(members[0].shards, [0, 1, 2, 3]);
        }
        // The longest name in 4-byte characters.
        let emoji = "🚀".repeat(MAX_GROUP_NAME_BYTES / 4);
        let view = store.renew_group(&renewal(&emoji, "m")).await.unwrap();
        assert_eq!(view.owned.len(), 4);
        assert_eq!(store.group_status(&emoji).await.unwrap().len(), 1);

        store.pool().close().await;
        sqlx::query(&format!("DROP DATABASE `{database}`"))
            .execute(&admin)
            .await
            .unwrap();
    }
}
