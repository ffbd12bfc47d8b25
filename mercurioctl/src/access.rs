//! `mercurioctl user|group|role|acl ...` and `auth import`: the users, groups, roles and rules
//! a running broker keeps in storage (`[auth] backend = "storage"`), after mosquitto_ctrl's
//! dynamic security commands (createClient -> `user add`, deleteClient -> `user remove`,
//! addGroupClient -> `group add-user`, addGroupRole -> `group add-role`, addRoleACL ->
//! `acl add`, ...). A password is read from standard input (`--stdin`) or asked on the
//! terminal, never taken from the command line; mercurioctl turns it into an argon2id hash
//! and SCRAM keys, so the password itself never reaches the broker.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use mercurio_core::admin::Request;
use mercurio_core::auth::acl::Acl;
use mercurio_core::auth::password_file::PasswordFile;
use mercurio_core::auth::stored::{Credentials, ANONYMOUS_GROUP};
use serde_json::Value;

#[derive(Debug, Subcommand)]
pub enum UserCommand {
    /// Add a user; its password is asked twice on the terminal, or read from the first line
    /// of standard input with --stdin. It connects at once (password, or SCRAM-SHA-256 /
    /// SCRAM-SHA-512).
    Add {
        /// The user name.
        username: String,
        /// Read the password from the first line of standard input.
        #[arg(long)]
        stdin: bool,
    },
    /// Change a user's password (asked, or --stdin); its connected clients stay connected.
    Passwd {
        /// The user name.
        username: String,
        /// Read the password from the first line of standard input.
        #[arg(long)]
        stdin: bool,
    },
    /// Remove a user; its connected clients are disconnected (MQTT 5: DISCONNECT 0x98).
    Remove {
        /// The user name.
        username: String,
    },
    /// Every stored user with its groups and roles.
    List,
    /// One user: groups, roles, SCRAM mechanisms, and the rules it gets.
    Show {
        /// The user name.
        username: String,
    },
    /// Give a user a role of its own.
    AddRole {
        /// The user name.
        username: String,
        /// The role.
        role: String,
    },
    /// Take a role of its own from a user.
    RemoveRole {
        /// The user name.
        username: String,
        /// The role.
        role: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum GroupCommand {
    /// Create an empty group (the group named anonymous gives its roles to clients without
    /// a user name).
    Create {
        /// The group's name.
        group: String,
    },
    /// Delete a group; its users leave it.
    Delete {
        /// The group's name.
        group: String,
    },
    /// Every group with its roles and users.
    List,
    /// One group: roles and users.
    Show {
        /// The group's name.
        group: String,
    },
    /// Put a user in a group.
    AddUser {
        /// The group's name.
        group: String,
        /// The user name.
        username: String,
    },
    /// Take a user out of a group.
    RemoveUser {
        /// The group's name.
        group: String,
        /// The user name.
        username: String,
    },
    /// Give a group's users a role.
    AddRole {
        /// The group's name.
        group: String,
        /// The role.
        role: String,
    },
    /// Take a role from a group.
    RemoveRole {
        /// The group's name.
        group: String,
        /// The role.
        role: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum RoleCommand {
    /// Create a role without rules.
    Create {
        /// The role's name.
        role: String,
    },
    /// Delete a role; users and groups lose it.
    Delete {
        /// The role's name.
        role: String,
    },
    /// Every role with its rules.
    List,
    /// One role: its rules, and the users and groups that have it.
    Show {
        /// The role's name.
        role: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum AclCommand {
    /// Add a rule to a role: ACCESS is read, write, readwrite or deny (a deny that matches
    /// wins); TOPIC a topic filter where %c and %u stand for the client identifier and the
    /// user name. Connected clients lose at once what the change takes away.
    Add {
        /// The role's name.
        role: String,
        /// read, write, readwrite or deny.
        access: String,
        /// A topic filter.
        topic: String,
    },
    /// Remove a rule from a role.
    Remove {
        /// The role's name.
        role: String,
        /// read, write, readwrite or deny.
        access: String,
        /// The rule's topic filter.
        topic: String,
    },
}

/// `auth import`: a password file and an ACL file into the broker's storage.
#[derive(Debug, Args)]
pub struct Import {
    /// A password file (mosquitto_passwd's format): each user is added with its hash
    /// (SCRAM needs a password set with `user passwd`); a user stored already gets the
    /// file's hash.
    #[arg(long, value_name = "FILE")]
    pub password_file: Option<PathBuf>,
    /// An ACL file (mosquitto's format): each user section becomes the role user:NAME given
    /// to that user (a user that is not stored is skipped, with a warning), the lines before
    /// any user the role anonymous of the group anonymous, the pattern lines the role
    /// patterns given to every imported user and to the group anonymous.
    #[arg(long, value_name = "FILE")]
    pub acl_file: Option<PathBuf>,
}

fn password_credentials(stdin: bool) -> Result<Value, String> {
    let password = crate::passwd::read_password(stdin)?;
    let credentials = Credentials::from_password(password.as_bytes())?;
    serde_json::to_value(credentials).map_err(|e| e.to_string())
}

pub fn user_request(c: &UserCommand) -> Result<Request, String> {
    Ok(match c {
        UserCommand::Add { username, stdin } => Request::UserAdd {
            username: username.clone(),
            credentials: password_credentials(*stdin)?,
        },
        UserCommand::Passwd { username, stdin } => Request::UserPasswd {
            username: username.clone(),
            credentials: password_credentials(*stdin)?,
        },
        UserCommand::Remove { username } => Request::UserRemove {
            username: username.clone(),
        },
        UserCommand::List => Request::UserList,
        UserCommand::Show { username } => Request::UserShow {
            username: username.clone(),
        },
        UserCommand::AddRole { username, role } => Request::UserAddRole {
            username: username.clone(),
            role: role.clone(),
        },
        UserCommand::RemoveRole { username, role } => Request::UserRemoveRole {
            username: username.clone(),
            role: role.clone(),
        },
    })
}

pub fn group_request(c: &GroupCommand) -> Request {
    match c {
        GroupCommand::Create { group } => Request::GroupCreate {
            group: group.clone(),
        },
        GroupCommand::Delete { group } => Request::GroupDelete {
            group: group.clone(),
        },
        GroupCommand::List => Request::GroupList,
        GroupCommand::Show { group } => Request::GroupShow {
            group: group.clone(),
        },
        GroupCommand::AddUser { group, username } => Request::GroupAddUser {
            group: group.clone(),
            username: username.clone(),
        },
        GroupCommand::RemoveUser { group, username } => Request::GroupRemoveUser {
            group: group.clone(),
            username: username.clone(),
        },
        GroupCommand::AddRole { group, role } => Request::GroupAddRole {
            group: group.clone(),
            role: role.clone(),
        },
        GroupCommand::RemoveRole { group, role } => Request::GroupRemoveRole {
            group: group.clone(),
            role: role.clone(),
        },
    }
}

pub fn role_request(c: &RoleCommand) -> Request {
    match c {
        RoleCommand::Create { role } => Request::RoleCreate { role: role.clone() },
        RoleCommand::Delete { role } => Request::RoleDelete { role: role.clone() },
        RoleCommand::List => Request::RoleList,
        RoleCommand::Show { role } => Request::RoleShow { role: role.clone() },
    }
}

pub fn acl_request(c: &AclCommand) -> Request {
    match c {
        AclCommand::Add {
            role,
            access,
            topic,
        } => Request::AclAdd {
            role: role.clone(),
            access: access.clone(),
            topic: topic.clone(),
        },
        AclCommand::Remove {
            role,
            access,
            topic,
        } => Request::AclRemove {
            role: role.clone(),
            access: access.clone(),
            topic: topic.clone(),
        },
    }
}

/// One step of an import: the request, and whether a `conflict` answer is expected (the
/// thing exists already) and followed by `then`.
pub struct Step {
    pub request: Request,
    /// Sent instead when `request` is refused with `conflict`.
    pub on_conflict: Option<Request>,
}

/// The requests that import the files, in order. Errors: a file that cannot be read or
/// parsed (path, line, cause).
pub fn import_steps(import: &Import) -> Result<(Vec<Step>, Vec<String>), String> {
    let mut steps = Vec::new();
    let mut warnings = Vec::new();
    let mut users: Vec<String> = Vec::new();
    if let Some(path) = &import.password_file {
        let file = PasswordFile::load(path).map_err(|e| e.to_string())?;
        let mut entries: Vec<_> = file.users().collect();
        entries.sort_by(|a, b| a.0.cmp(b.0));
        for (user, hash) in entries {
            let credentials = serde_json::to_value(Credentials {
                password_hash: Some(hash.to_string()),
                scram: Vec::new(),
            })
            .map_err(|e| e.to_string())?;
            steps.push(Step {
                request: Request::UserAdd {
                    username: user.to_string(),
                    credentials: credentials.clone(),
                },
                on_conflict: Some(Request::UserPasswd {
                    username: user.to_string(),
                    credentials,
                }),
            });
            users.push(user.to_string());
        }
    }
    if let Some(path) = &import.acl_file {
        let acl = Acl::load(path).map_err(|e| e.to_string())?;
        let role = |steps: &mut Vec<Step>,
                    name: &str,
                    rules: &[(mercurio_core::auth::acl::Access, &str)]| {
            steps.push(Step {
                request: Request::RoleCreate {
                    role: name.to_string(),
                },
                on_conflict: None,
            });
            for (access, topic) in rules {
                steps.push(Step {
                    request: Request::AclAdd {
                        role: name.to_string(),
                        access: access.as_str().to_string(),
                        topic: topic.to_string(),
                    },
                    on_conflict: None,
                });
            }
        };
        let patterns = acl.pattern_rules();
        if !patterns.is_empty() {
            role(&mut steps, "patterns", &patterns);
        }
        for (user, rules) in acl.user_rules() {
            if import.password_file.is_some() && !users.iter().any(|u| u == user) {
                warnings.push(format!(
                    "ACL user {user} is not in the password file: its rules are imported as role user:{user}, given to {user} only if it is stored already"
                ));
            }
            let name = format!("user:{user}");
            role(&mut steps, &name, &rules);
            steps.push(Step {
                request: Request::UserAddRole {
                    username: user.to_string(),
                    role: name,
                },
                on_conflict: None,
            });
            if !patterns.is_empty() {
                steps.push(Step {
                    request: Request::UserAddRole {
                        username: user.to_string(),
                        role: "patterns".into(),
                    },
                    on_conflict: None,
                });
            }
        }
        let anonymous = acl.anonymous_rules();
        if !anonymous.is_empty() || !patterns.is_empty() {
            steps.push(Step {
                request: Request::GroupCreate {
                    group: ANONYMOUS_GROUP.into(),
                },
                on_conflict: None,
            });
            if !anonymous.is_empty() {
                role(&mut steps, "anonymous", &anonymous);
                steps.push(Step {
                    request: Request::GroupAddRole {
                        group: ANONYMOUS_GROUP.into(),
                        role: "anonymous".into(),
                    },
                    on_conflict: None,
                });
            }
            if !patterns.is_empty() {
                steps.push(Step {
                    request: Request::GroupAddRole {
                        group: ANONYMOUS_GROUP.into(),
                        role: "patterns".into(),
                    },
                    on_conflict: None,
                });
            }
        }
        // Users of the password file without a section get the pattern lines too.
        if !patterns.is_empty() {
            let sections: Vec<&str> = acl.user_rules().iter().map(|(u, _)| *u).collect();
            for user in users.iter().filter(|u| !sections.contains(&u.as_str())) {
                steps.push(Step {
                    request: Request::UserAddRole {
                        username: user.clone(),
                        role: "patterns".into(),
                    },
                    on_conflict: None,
                });
            }
        }
    }
    if import.password_file.is_none() && import.acl_file.is_none() {
        return Err("nothing to import: give --password-file and/or --acl-file".into());
    }
    Ok((steps, warnings))
}

/// A JSON value as text: strings without quotes.
fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_string(),
        other => other.to_string(),
    }
}

fn names(v: &Value) -> String {
    let list: Vec<String> = v
        .as_array()
        .map(|a| a.iter().map(text).collect())
        .unwrap_or_default();
    if list.is_empty() {
        "-".to_string()
    } else {
        list.join(", ")
    }
}

fn rules(v: &Value) -> String {
    let list = v.as_array().cloned().unwrap_or_default();
    if list.is_empty() {
        return "  none\n".to_string();
    }
    list.iter()
        .map(|r| format!("  {:<9}  {}\n", text(&r["access"]), text(&r["topic"])))
        .collect()
}

/// The answer to a `user`, `group`, `role` or `acl` command, for people.
pub fn human(request: &Request, r: &Value) -> String {
    match request {
        Request::UserList => {
            let users = r["users"].as_array().cloned().unwrap_or_default();
            if users.is_empty() {
                return "no users\n".to_string();
            }
            let rows: Vec<[String; 4]> = users
                .iter()
                .map(|u| {
                    [
                        text(&u["username"]),
                        names(&u["groups"]),
                        names(&u["roles"]),
                        names(&u["scram"]),
                    ]
                })
                .collect();
            let width = |i: usize, title: &str| {
                rows.iter()
                    .map(|r| r[i].chars().count())
                    .max()
                    .unwrap_or(0)
                    .max(title.len())
            };
            let (w0, w1, w2) = (width(0, "USER"), width(1, "GROUPS"), width(2, "ROLES"));
            let mut out = format!(
                "{:<w0$}  {:<w1$}  {:<w2$}  SCRAM\n",
                "USER", "GROUPS", "ROLES"
            );
            for r in &rows {
                out.push_str(&format!(
                    "{:<w0$}  {:<w1$}  {:<w2$}  {}\n",
                    r[0], r[1], r[2], r[3]
                ));
            }
            out
        }
        Request::UserShow { .. } => format!(
            "user      {}\ngroups    {}\nroles     {}\npassword  {}\nscram     {}\nrules\n{}",
            text(&r["username"]),
            names(&r["groups"]),
            names(&r["roles"]),
            if r["password"].as_bool() == Some(true) {
                "set"
            } else {
                "none (SCRAM only)"
            },
            names(&r["scram"]),
            rules(&r["rules"])
        ),
        Request::GroupList => {
            let groups = r["groups"].as_array().cloned().unwrap_or_default();
            if groups.is_empty() {
                return "no groups\n".to_string();
            }
            groups
                .iter()
                .map(|g| {
                    format!(
                        "{}  roles: {}  users: {}\n",
                        text(&g["group"]),
                        names(&g["roles"]),
                        names(&g["users"])
                    )
                })
                .collect()
        }
        Request::GroupShow { .. } => format!(
            "group  {}\nroles  {}\nusers  {}\n",
            text(&r["group"]),
            names(&r["roles"]),
            names(&r["users"])
        ),
        Request::RoleList => {
            let roles = r["roles"].as_array().cloned().unwrap_or_default();
            if roles.is_empty() {
                return "no roles\n".to_string();
            }
            roles
                .iter()
                .map(|x| format!("{}\n{}", text(&x["role"]), rules(&x["rules"])))
                .collect()
        }
        Request::RoleShow { .. } => format!(
            "role    {}\nusers   {}\ngroups  {}\nrules\n{}",
            text(&r["role"]),
            names(&r["users"]),
            names(&r["groups"]),
            rules(&r["rules"])
        ),
        Request::UserRemove { username } => format!(
            "removed user {username} ({} client(s) disconnected)\n",
            text(&r["disconnected"])
        ),
        _ => "done\n".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn user_table_and_rules() {
        let r = json!({"users": [
            {"username": "sensor-12", "groups": ["fleet"], "roles": [], "scram": ["SCRAM-SHA-256"]},
            {"username": "a", "groups": [], "roles": ["r"], "scram": []},
        ]});
        let out = human(&Request::UserList, &r);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "USER       GROUPS  ROLES  SCRAM");
        assert_eq!(lines[1], "sensor-12  fleet   -      SCRAM-SHA-256");
        assert_eq!(lines[2], "a          -       r      -");
        let role = json!({"role": "r", "rules": [{"access": "read", "topic": "t/#"}],
            "users": ["a"], "groups": []});
        let out = human(&Request::RoleShow { role: "r".into() }, &role);
        assert!(out.contains("  read       t/#\n"), "{out}");
        assert_eq!(
            human(&Request::GroupList, &json!({"groups": []})),
            "no groups\n"
        );
    }

    #[test]
    fn import_maps_sections_to_roles() {
        let dir = tempfile::tempdir().expect("dir");
        let acl = dir.path().join("acl");
        std::fs::write(
            &acl,
            "topic read pub/#\nuser u\ntopic t/#\npattern write p/%c\n",
        )
        .expect("acl");
        let (steps, warnings) = import_steps(&Import {
            password_file: None,
            acl_file: Some(acl),
        })
        .expect("steps");
        assert!(warnings.is_empty());
        let lines: Vec<String> = steps.iter().map(|s| s.request.to_line()).collect();
        let has = |l: &str| lines.iter().any(|x| x == l);
        assert!(
            has(r#"{"command":"role.create","role":"patterns"}"#),
            "{lines:?}"
        );
        assert!(has(
            r#"{"command":"acl.add","role":"user:u","access":"readwrite","topic":"t/#"}"#
        ));
        assert!(has(
            r#"{"command":"user.add-role","username":"u","role":"user:u"}"#
        ));
        assert!(has(
            r#"{"command":"acl.add","role":"anonymous","access":"read","topic":"pub/#"}"#
        ));
        assert!(has(
            r#"{"command":"group.add-role","group":"anonymous","role":"patterns"}"#
        ));
    }
}
