//! Topic name and topic filter rules: validation, shared-subscription parsing and matching
//! (MQTT 5.0 sections 4.7 and 4.8.2; MQTT 3.1.1 section 4.7).

use mercurio_core::topic::{
    matches, parse_shared, validate_subscription_filter, validate_topic_filter,
    validate_topic_name, SharedFilter, TopicError, MAX_TOPIC_LEN,
};

// ---- validation of topic names ----

#[test]
fn topic_names_are_at_least_one_character_long() {
    // [MQTT-4.7.3-1] All Topic Names and Topic Filters MUST be at least one character long.
    assert_eq!(validate_topic_name(""), Err(TopicError::Empty));
    assert_eq!(validate_topic_name("a"), Ok(()));
    assert_eq!(validate_topic_name("/"), Ok(()));
}

#[test]
fn topic_names_contain_no_wildcards() {
    // [MQTT-3.3.2-2] The Topic Name in the PUBLISH packet MUST NOT contain wildcard characters.
    for name in ["#", "+", "a/#", "a/+/b", "a+", "sport/tennis#", "+/x"] {
        assert_eq!(
            validate_topic_name(name),
            Err(TopicError::WildcardInTopicName),
            "{name}"
        );
    }
}

#[test]
fn topic_names_contain_no_null_character() {
    // [MQTT-4.7.3-2] Topic Names and Topic Filters MUST NOT include the null character.
    assert_eq!(validate_topic_name("a\0b"), Err(TopicError::NullCharacter));
    assert_eq!(
        validate_topic_filter("a/\0"),
        Err(TopicError::NullCharacter)
    );
    assert_eq!(
        validate_topic_filter("$share/g\0/a"),
        Err(TopicError::NullCharacter)
    );
    assert_eq!(parse_shared("$share/g/\0"), Err(TopicError::NullCharacter));
}

#[test]
fn topic_length_is_at_most_65535_bytes() {
    // [MQTT-4.7.3-3] Topic Names and Topic Filters ... MUST NOT encode to more than 65,535 bytes.
    let max = "a".repeat(MAX_TOPIC_LEN);
    assert_eq!(validate_topic_name(&max), Ok(()));
    assert_eq!(validate_topic_filter(&max), Ok(()));
    let over = "a".repeat(MAX_TOPIC_LEN + 1);
    assert_eq!(
        validate_topic_name(&over),
        Err(TopicError::TooLong(MAX_TOPIC_LEN + 1))
    );
    assert_eq!(
        validate_topic_filter(&over),
        Err(TopicError::TooLong(MAX_TOPIC_LEN + 1))
    );
    // Bytes, not characters: 21,846 three-byte characters are 65,538 bytes.
    let wide = "€".repeat(21_846);
    assert!(matches!(
        validate_topic_name(&wide),
        Err(TopicError::TooLong(65_538))
    ));
}

#[test]
fn empty_levels_and_dollar_topics_are_valid_names() {
    for name in [
        "/",
        "//",
        "/finance",
        "finance/",
        "a//b",
        "$SYS/broker/uptime",
        "ä/ö",
        " ",
    ] {
        assert_eq!(validate_topic_name(name), Ok(()), "{name}");
    }
}

// ---- validation of topic filters ----

#[test]
fn filters_are_at_least_one_character_long() {
    // [MQTT-4.7.3-1]
    assert_eq!(validate_topic_filter(""), Err(TopicError::Empty));
}

#[test]
fn multi_level_wildcard_is_alone_and_last() {
    // [MQTT-4.7.1-2] The multi-level wildcard character MUST be specified either on its own or
    // following a topic level separator. In either case it MUST be the last character.
    for ok in ["#", "sport/#", "sport/tennis/#", "/#", "+/#", "//#"] {
        assert_eq!(validate_topic_filter(ok), Ok(()), "{ok}");
    }
    // The specification's own examples of invalid filters: "sport/tennis#", "sport/tennis/#/ranking".
    for bad in [
        "sport/tennis#",
        "sport/tennis/#/ranking",
        "#/",
        "##",
        "a/#b",
        "a#/b",
        "#/#",
    ] {
        assert_eq!(
            validate_topic_filter(bad),
            Err(TopicError::MisplacedMultiLevelWildcard),
            "{bad}"
        );
    }
}

#[test]
fn single_level_wildcard_fills_a_level() {
    // [MQTT-4.7.1-3] The single-level wildcard can be used at any level in the Topic Filter,
    // including first and last levels. Where it is used it MUST occupy an entire level.
    // Valid per the specification: "+", "+/tennis/#", "sport/+/player1".
    for ok in [
        "+",
        "+/tennis/#",
        "sport/+/player1",
        "+/+",
        "/+",
        "+/",
        "a/+/+/b",
    ] {
        assert_eq!(validate_topic_filter(ok), Ok(()), "{ok}");
    }
    // Not valid: "sport+".
    for bad in ["sport+", "a/+b", "++", "a/b+/c"] {
        assert_eq!(
            validate_topic_filter(bad),
            Err(TopicError::MisplacedSingleLevelWildcard),
            "{bad}"
        );
    }
}

#[test]
fn filters_with_empty_levels_are_valid() {
    for ok in ["a//b", "/a", "a/", "/", "//", "/+/", "$SYS/#", "$share"] {
        assert_eq!(validate_topic_filter(ok), Ok(()), "{ok}");
    }
}

#[test]
fn errors_display_a_clear_message() {
    let msg = validate_topic_filter("a/#/b").unwrap_err().to_string();
    assert!(msg.contains("'#'") && msg.contains("MQTT-4.7.1-2"), "{msg}");
    let msg = validate_topic_name("").unwrap_err().to_string();
    assert!(msg.contains("at least one character"), "{msg}");
    let msg = parse_shared("$share//a").unwrap_err().to_string();
    assert!(msg.contains("ShareName"), "{msg}");
}

// ---- shared subscriptions ----

#[test]
fn shared_filters_are_split_into_share_name_and_filter() {
    // MQTT 5.0 section 4.8.2: $share/{ShareName}/{filter}
    assert_eq!(
        parse_shared("$share/consumer1/sport/tennis/+"),
        Ok(Some(SharedFilter {
            group: "consumer1",
            filter: "sport/tennis/+"
        }))
    );
    assert_eq!(
        parse_shared("$share/g/#"),
        Ok(Some(SharedFilter {
            group: "g",
            filter: "#"
        }))
    );
    // The filter part may itself start with "/" (an empty first level).
    assert_eq!(
        parse_shared("$share/g//a"),
        Ok(Some(SharedFilter {
            group: "g",
            filter: "/a"
        }))
    );
}

#[test]
fn ordinary_filters_are_not_shared() {
    for f in [
        "sport/#",
        "$share",
        "$SYS/#",
        "$shared/g/a",
        "share/g/a",
        "$Share/g/a",
        "#",
    ] {
        assert_eq!(parse_shared(f), Ok(None), "{f}");
    }
}

#[test]
fn share_name_is_at_least_one_character() {
    // [MQTT-4.8.2-1] A Shared Subscription's Topic Filter MUST start with $share/ and MUST
    // contain a ShareName that is at least one character long.
    assert_eq!(parse_shared("$share/"), Err(TopicError::MissingShareName));
    assert_eq!(parse_shared("$share//a"), Err(TopicError::MissingShareName));
}

#[test]
fn share_name_has_no_wildcards_and_is_followed_by_a_filter() {
    // [MQTT-4.8.2-2] The ShareName MUST NOT contain the characters "/", "+" or "#", but MUST
    // be followed by a "/" character. This "/" character MUST be followed by a Topic Filter.
    assert_eq!(
        parse_shared("$share/a+/x"),
        Err(TopicError::InvalidShareName)
    );
    assert_eq!(
        parse_shared("$share/#/x"),
        Err(TopicError::InvalidShareName)
    );
    assert_eq!(parse_shared("$share/+"), Err(TopicError::InvalidShareName));
    assert_eq!(
        parse_shared("$share/g"),
        Err(TopicError::MissingSharedFilter)
    );
    assert_eq!(
        parse_shared("$share/g/"),
        Err(TopicError::MissingSharedFilter)
    );
    // The filter part obeys the filter rules.
    assert_eq!(
        parse_shared("$share/g/a/#/b"),
        Err(TopicError::MisplacedMultiLevelWildcard)
    );
    assert_eq!(
        parse_shared("$share/g/a+"),
        Err(TopicError::MisplacedSingleLevelWildcard)
    );
}

#[test]
fn subscription_filters_accept_both_forms() {
    assert_eq!(validate_subscription_filter("$share/g/a/+"), Ok(()));
    assert_eq!(validate_subscription_filter("a/+"), Ok(()));
    assert_eq!(
        validate_subscription_filter("$share/g"),
        Err(TopicError::MissingSharedFilter)
    );
    assert_eq!(
        validate_subscription_filter("a/#/"),
        Err(TopicError::MisplacedMultiLevelWildcard)
    );
    let long = format!("$share/g/{}", "a".repeat(MAX_TOPIC_LEN));
    assert!(matches!(
        validate_subscription_filter(&long),
        Err(TopicError::TooLong(_))
    ));
}

// ---- matching ----

#[test]
fn multi_level_wildcard_examples_of_section_4_7_1_2() {
    // "sport/tennis/player1/#" would receive messages published using any of these names.
    for topic in [
        "sport/tennis/player1",
        "sport/tennis/player1/ranking",
        "sport/tennis/player1/score/wimbledon",
    ] {
        assert!(matches("sport/tennis/player1/#", topic), "{topic}");
    }
    // "sport/#" also matches the singular "sport", since # includes the parent level.
    assert!(matches("sport/#", "sport"));
    assert!(matches("sport/#", "sport/"));
    assert!(!matches("sport/#", "sports"));
    assert!(!matches("sport/tennis/player1/#", "sport/tennis"));
    // "#" matches every topic not starting with "$".
    for topic in ["a", "/", "a/b/c", "/finance"] {
        assert!(matches("#", topic), "{topic}");
    }
}

#[test]
fn single_level_wildcard_examples_of_section_4_7_1_3() {
    // "sport/tennis/+" matches "sport/tennis/player1" and "sport/tennis/player2", but not
    // "sport/tennis/player1/ranking".
    assert!(matches("sport/tennis/+", "sport/tennis/player1"));
    assert!(matches("sport/tennis/+", "sport/tennis/player2"));
    assert!(!matches("sport/tennis/+", "sport/tennis/player1/ranking"));
    // "sport/+" does not match "sport" but does match "sport/".
    assert!(!matches("sport/+", "sport"));
    assert!(matches("sport/+", "sport/"));
    // "+/+" and "/+" match "/finance"; "+" does not.
    assert!(matches("+/+", "/finance"));
    assert!(matches("/+", "/finance"));
    assert!(!matches("+", "/finance"));
    assert!(matches("+/tennis/#", "sport/tennis/x/y"));
    assert!(matches("sport/+/player1", "sport/tennis/player1"));
}

#[test]
fn topic_level_separator_and_empty_levels() {
    // Section 4.7.1.1: adjacent separators are a zero-length level.
    assert!(matches("a//b", "a//b"));
    assert!(!matches("a//b", "a/b"));
    assert!(matches("a/+/b", "a//b"));
    assert!(!matches("/a", "a"));
    assert!(matches("a/", "a/"));
    assert!(!matches("a/", "a"));
}

#[test]
fn matching_is_case_sensitive_without_normalisation() {
    // [MQTT-4.7.3-4] When it performs subscription matching the Server MUST NOT perform any
    // normalization of Topic Names or Topic Filters.
    assert!(!matches("ACCOUNTS", "Accounts"));
    assert!(!matches("a/b", "a/b "));
    assert!(matches("Accounts payable", "Accounts payable"));
}

#[test]
fn wildcards_at_the_start_do_not_match_dollar_topics() {
    // [MQTT-4.7.2-1] The Server MUST NOT match Topic Filters starting with a wildcard
    // character (# or +) with Topic Names beginning with a $ character.
    assert!(!matches("#", "$SYS/monitor/Clients"));
    assert!(!matches("+/monitor/Clients", "$SYS/monitor/Clients"));
    assert!(!matches("+", "$SYS"));
    assert!(!matches("#", "$"));
    // Section 4.7.2 examples: "$SYS/#" and "$SYS/monitor/+" do.
    assert!(matches("$SYS/#", "$SYS/monitor/Clients"));
    assert!(matches("$SYS/monitor/+", "$SYS/monitor/Clients"));
    assert!(matches("$SYS/#", "$SYS"));
    // A "$" later in the topic is an ordinary character.
    assert!(matches("+/$x", "a/$x"));
    assert!(matches("a/#", "a/$SYS"));
    assert!(matches("a/+", "a/$SYS"));
}

#[test]
fn literal_filters_match_only_themselves() {
    assert!(matches("a/b/c", "a/b/c"));
    assert!(!matches("a/b/c", "a/b"));
    assert!(!matches("a/b", "a/b/c"));
    assert!(!matches("a/b/c", "a/b/d"));
}
